"""Charts of bench results, each drawn on one matplotlib Axes.

A chart takes labelled results ``[(label, result), ...]`` and draws every result it
applies to, one colour each, so one call both shows and compares. Sweeps contribute
each of their points to the per-request charts.
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
        else:
            out.append((label, r))
    return out


def of_kind(results: Labelled, kind: str) -> Labelled:
    return [(lb, r) for lb, r in results if r["kind"] == kind]


def ok_mask(r: dict) -> np.ndarray:
    return np.array([not e for e in r["errors"]], dtype=bool)


def draw_cdf(ax: Axes, results: Labelled, values: Callable[[dict], np.ndarray],
             xlabel: str) -> None:
    for label, r in points(results):
        x = np.sort(values(r))
        if len(x):
            ax.step(x, np.arange(1, len(x) + 1) / len(x), where="post", label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)


def ttft_cdf(ax: Axes, results: Labelled) -> None:
    draw_cdf(ax, results, lambda r: np.asarray(r["ttfts"])[ok_mask(r)] * 1000.0, "TTFT (ms)")


def itl_cdf(ax: Axes, results: Labelled) -> None:
    draw_cdf(ax, results, lambda r: np.array([g for i in r["itls"] for g in i]) * 1000.0,
             "inter-token latency (ms)")


def ttft_vs_prompt(ax: Axes, results: Labelled) -> None:
    for label, r in points(results):
        ok = ok_mask(r)
        ax.scatter(np.asarray(r["input_lens"])[ok], np.asarray(r["ttfts"])[ok] * 1000.0,
                   s=8, alpha=0.6, label=label)
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("TTFT (ms)")
    ax.grid(alpha=0.3)


def per_class(ax: Axes, results: Labelled) -> None:
    """Mean TTFT bars per class and result; the black tick marks P99."""
    pts = points(results)
    classes = sorted({c for _, r in pts for c in r["per_class"]})
    width = 0.8 / max(1, len(pts))
    for k, (label, r) in enumerate(pts):
        x = np.arange(len(classes)) + k * width
        stats = [r["per_class"].get(c, {}) for c in classes]  # NaN: class absent, no bar
        ax.bar(x, [s.get("mean_ttft_ms", np.nan) for s in stats], width, label=label)
        ax.scatter(x, [s.get("p99_ttft_ms", np.nan) for s in stats], marker="_", s=200, c="k")
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


CHARTS = (
    Chart("TTFT CDF", ("serving", "traffic", "sweep"), ttft_cdf),
    Chart("Inter-token latency CDF", ("serving", "traffic", "sweep"), itl_cdf),
    Chart("TTFT versus prompt length", ("serving", "traffic", "sweep"), ttft_vs_prompt),
    Chart("TTFT per request class", ("serving", "traffic", "sweep"), per_class),
    Chart("Latency versus load", ("sweep",), latency_vs_load),
    Chart("Throughput versus offered load", ("sweep",), throughput_vs_load),
    Chart("Traffic: requests in flight and errors", ("traffic",), traffic_load),
    Chart("Traffic: TTFT over time", ("traffic",), traffic_ttft),
)


def applicable(results: Labelled) -> list[Chart]:
    kinds = {r["kind"] for _, r in results}
    return [c for c in CHARTS if kinds & set(c.kinds)]


def draw(chart: Chart, ax: Axes, results: Labelled) -> None:
    chart.draw(ax, results)
    ax.set_title(chart.title)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")
