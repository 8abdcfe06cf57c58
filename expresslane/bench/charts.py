"""Charts of bench results, each drawn on one matplotlib Axes.

A chart takes labelled results ``[(label, result), ...]`` and draws every result it
applies to, one colour each, so one call both shows and compares. Sweeps contribute
each of their points to the per-request charts.

Failed requests are drawn as failures, never as 0 ms: a CDF is a fraction of *all*
requests (failures never arrive, so the curve stops below 1 and the legend says how
many failed), failed requests are red crosses on the top edge of a scatter, and a
class whose every request failed gets no bar but a note.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from matplotlib.axes import Axes

Labelled = list[tuple[str, dict]]


@dataclass(frozen=True, slots=True)
class Chart:
    title: str
    kinds: tuple[str, ...]  # the result kinds it has something to draw for
    draw: Callable[[Axes, Labelled], None]


def points(results: Labelled) -> Labelled:
    """Serving and traffic results, with sweeps unrolled into their points."""
    out = []
    for label, r in results:
        if r["kind"] == "sweep":
            out += [(f"{label} {r['variable']}={v:g}", p)
                    for v, p in zip(r["values"], r["results"])]
        elif r["kind"] in ("serving", "traffic"):
            out.append((label, r))
    return out


def of_kind(results: Labelled, kind: str) -> Labelled:
    return [(lb, r) for lb, r in results if r["kind"] == kind]


def ok_mask(r: dict) -> np.ndarray:
    return np.array([not e for e in r["errors"]], dtype=bool)


def failed_note(r: dict) -> str:
    return f" ({r['failed']} of {r['completed'] + r['failed']} failed)" if r["failed"] else ""


def draw_cdf(ax: Axes, results: Labelled, values: Callable[[dict], np.ndarray],
             xlabel: str, per_request: bool = True) -> None:
    """``values`` of the successful requests; with ``per_request`` the curve is a fraction of
    every request, failed ones included (they never reach it)."""
    for label, r in points(results):
        x = np.sort(values(r))
        n = r["completed"] + r["failed"] if per_request else len(x)
        if len(x):
            ax.step(x, np.arange(1, len(x) + 1) / n, where="post", label=label + failed_note(r))
        elif r["failed"]:
            ax.plot([], [], label=f"{label}: every request failed")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)


def ttft_cdf(ax: Axes, results: Labelled) -> None:
    draw_cdf(ax, results, lambda r: np.asarray(r["ttfts"])[ok_mask(r)] * 1000.0, "TTFT (ms)")


def itl_cdf(ax: Axes, results: Labelled) -> None:
    draw_cdf(ax, results, lambda r: np.array([g for i in r["itls"] for g in i]) * 1000.0,
             "inter-token latency (ms)", per_request=False)


def ttft_vs_prompt(ax: Axes, results: Labelled) -> None:
    for label, r in points(results):
        ok = ok_mask(r)
        lens = np.asarray(r["input_lens"])
        ax.scatter(lens[ok], np.asarray(r["ttfts"])[ok] * 1000.0, s=8, alpha=0.6, label=label)
        if (~ok).any():  # failures have no TTFT: crosses on the top edge, at their prompt length
            ax.scatter(lens[~ok], np.ones((~ok).sum()), marker="x", c="red", s=30,
                       transform=ax.get_xaxis_transform(), clip_on=False,
                       label=f"{label}: {(~ok).sum()} failed")
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("TTFT (ms)")
    ax.grid(alpha=0.3)


def chart_classes(r: dict) -> list[str]:
    """A result's classes, each request in one: its lanes if it sent any, else its lengths."""
    lanes = sorted(c for c in r["per_class"] if c.startswith("lane:"))
    return lanes or sorted(c for c in r["per_class"] if not c.startswith("lane:"))


def per_class(ax: Axes, results: Labelled) -> None:
    """Mean TTFT bars per class and result; the black tick marks P99. A class whose
    requests all failed has no bar, a note instead."""
    pts = points(results)
    classes = sorted({c for _, r in pts for c in chart_classes(r)})
    width = 0.8 / max(1, len(pts))
    for k, (label, r) in enumerate(pts):
        x = np.arange(len(classes)) + k * width
        mine = chart_classes(r)
        stats = [r["per_class"][c] if c in mine else {} for c in classes]  # absent: no bar
        mean = [s["mean_ttft_ms"] if s.get("completed") else np.nan for s in stats]
        p99 = [s["p99_ttft_ms"] if s.get("completed") else np.nan for s in stats]
        ax.bar(x, mean, width, label=label)
        ax.scatter(x, p99, marker="_", s=200, c="k")
        for xi, s in zip(x, stats):
            if s.get("failed"):
                note = "all failed" if not s["completed"] else f"{s['failed']} failed"
                ax.annotate(f"{note}\n({s['failed']}/{s['completed'] + s['failed']})",
                            (xi, 0), xycoords=("data", "axes fraction"), xytext=(0, 4),
                            textcoords="offset points", ha="center", color="red", fontsize=8)
    ax.set_xticks(np.arange(len(classes)) + width * (len(pts) - 1) / 2, classes)
    ax.set_ylabel("TTFT (ms): mean bar, P99 tick")
    ax.grid(alpha=0.3, axis="y")


def latency_vs_load(ax: Axes, results: Labelled) -> None:
    for label, s in of_kind(results, "sweep"):
        thr = [p["request_throughput"] for p in s["results"]]
        for key, style in (("p50_ttft_ms", "o-"), ("p99_ttft_ms", "s--"), ("p99_e2el_ms", "^:")):
            ax.plot(thr, [p[key] for p in s["results"]], style, label=f"{label} {key}")
    ax.set_xlabel("achieved throughput (req/s)")
    ax.set_ylabel("latency (ms)")
    ax.grid(alpha=0.3)


def throughput_vs_load(ax: Axes, results: Labelled) -> None:
    for label, s in of_kind(results, "sweep"):
        n = len(s["results"])
        ax.plot(s["values"][:n], [p["request_throughput"] for p in s["results"]], "o-",
                label=label)
        if s["saturated_at"] is not None:
            ax.axvline(s["saturated_at"], ls="--", c="r", alpha=0.6)
            ax.annotate("past saturation", (s["saturated_at"], 0), color="r",
                        xycoords=("data", "axes fraction"), xytext=(3, 5),
                        textcoords="offset points")
    variables = sorted({s["variable"] for _, s in of_kind(results, "sweep")})
    ax.set_xlabel(f"offered load ({' / '.join(variables)})")
    ax.set_ylabel("achieved throughput (req/s)")
    ax.grid(alpha=0.3)


def traffic_load(ax: Axes, results: Labelled) -> None:
    errors_ax = ax.twinx()
    for label, r in of_kind(results, "traffic"):
        ts = r["time_series"]
        # Buckets are [t, t+1): steps and bars start at their bucket's left edge, and the
        # repeated last value draws the last bucket to its right edge.
        edges = ts["t"] + [ts["t"][-1] + 1]
        line = ax.step(edges, ts["in_flight"] + ts["in_flight"][-1:], where="post",
                       label=f"{label} in flight")[0]
        errors_ax.bar(ts["t"], ts["errors"], width=1.0, align="edge", alpha=0.3,
                      color=line.get_color())
    ax.set_xlabel("time (s)")
    ax.set_ylim(bottom=0)
    ax.set_ylabel("requests in flight (line)")
    errors_ax.set_ylabel("errors per second (bars)")
    ax.grid(alpha=0.3)


def traffic_ttft(ax: Axes, results: Labelled) -> None:
    for label, r in of_kind(results, "traffic"):
        ts = r["time_series"]
        y = [np.nan if v is None else v for v in ts["mean_ttft_ms"]]
        ax.plot(np.asarray(ts["t"]) + 0.5, y, "o-", ms=3, label=label)  # bucket centres
    ax.set_xlabel("time (s)")
    ax.set_ylabel("mean TTFT (ms)")
    ax.grid(alpha=0.3)


def flat_alone(ax: Axes, results: Labelled) -> None:
    """(a) of flat-latency: TTFT of one prompt alone by its length, a line per row."""
    for label, r in of_kind(results, "flat-latency"):
        for row in r["rows"]:
            pts = [(a["input_len"], a["ttft_ms"]) for a in row["ttft_alone_ms"]]
            ok = [(n, t) for n, t in pts if t is not None]
            if ok:
                ax.plot(*zip(*ok), "o-", label=f"{label} {row['mode']}")
            for n, t in pts:
                if t is None:  # every repeat failed
                    ax.scatter([n], [1.0], marker="x", c="red", transform=ax.get_xaxis_transform())
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("TTFT alone (ms)")
    ax.grid(alpha=0.3)


def flat_mixed(ax: Axes, results: Labelled) -> None:
    """(b) of flat-latency: short TTFT alone and mixed with the long prompt, per row."""
    rows = [(f"{label} {row['mode']}", row) for label, r in of_kind(results, "flat-latency")
            for row in r["rows"]]
    x = np.arange(len(rows))
    for off, key, name in ((-0.2, "short_alone_ttft_ms", "short alone"),
                           (0.2, "short_mixed_ttft_ms", "short, long prompt first")):
        vals = [np.nan if row[key] is None else row[key] for _, row in rows]
        ax.bar(x + off, vals, 0.4, label=name)
    for xi, (_, row) in zip(x, rows):
        flat = row["flatness"]
        ax.annotate("failed" if flat is None else f"{flat:.2f}x", (xi, 1.0),
                    xycoords=("data", "axes fraction"), xytext=(0, -12), textcoords="offset points",
                    ha="center", fontsize=8, color="red" if flat is None else "k")
    ax.set_xticks(x, [name for name, _ in rows], rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("median TTFT (ms); flatness on top")
    ax.grid(alpha=0.3, axis="y")


def one_batch_steps(ax: Axes, results: Labelled) -> None:
    for label, r in of_kind(results, "one-batch"):
        steps = r["step_latencies_ms"]
        ax.plot(range(1, len(steps) + 1), steps, ".-", label=f"{label} (step 1 = prefill)")
        if r.get("floor_step_ms"):
            ax.axhline(r["floor_step_ms"], ls="--", c="r", alpha=0.6)
    ax.set_yscale("log")
    ax.set_xlabel("engine step")
    ax.set_ylabel("step latency (ms)")
    ax.grid(alpha=0.3)


REQUESTS = ("serving", "traffic", "sweep")
CHARTS = (
    Chart("TTFT CDF", REQUESTS, ttft_cdf),
    Chart("Inter-token latency CDF", REQUESTS, itl_cdf),
    Chart("TTFT versus prompt length", REQUESTS, ttft_vs_prompt),
    Chart("TTFT per request class (lanes, else lengths)", REQUESTS, per_class),
    Chart("Latency versus load", ("sweep",), latency_vs_load),
    Chart("Throughput versus offered load", ("sweep",), throughput_vs_load),
    Chart("Traffic: requests in flight and errors", ("traffic",), traffic_load),
    Chart("Traffic: TTFT over time", ("traffic",), traffic_ttft),
    Chart("Flat latency (a): TTFT alone by prompt length", ("flat-latency",), flat_alone),
    Chart("Flat latency (b): short prompts alone and mixed", ("flat-latency",), flat_mixed),
    Chart("One batch: step latencies", ("one-batch",), one_batch_steps),
)


def applicable(results: Labelled) -> list[Chart]:
    kinds = {r["kind"] for _, r in results}
    return [c for c in CHARTS if kinds & set(c.kinds)]


def draw(chart: Chart, ax: Axes, results: Labelled) -> None:
    chart.draw(ax, results)
    ax.set_title(chart.title)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")
