"""Tables and a chart of the flat-latency scenarios (``bench scenarios``, ``bench doctor``)."""

from __future__ import annotations

from pathlib import Path

from expresslane.bench.tables import Table, fmt, text_table


def times(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def scenario_tables(r: dict) -> list[tuple[str, Table]]:
    out = []
    if iso := r.get("isolated"):
        lens = list(iso["ttft_ms"])
        out.append((f"isolated: one prompt at a time (TTFT ms, median of {r['repeats']}); batch-1 ITL "
                    f"{fmt(iso['batch1_itl_ms'])} ms",
                    (["prompt tokens"] + lens, [["TTFT ms"] + [fmt(iso["ttft_ms"][n]) for n in lens]])))
    if b := r.get("beside_long"):
        a, s, q = b["alone"], b["beside"], b["ratios"]
        rows = [["short TTFT ms (median)", fmt(a["short_ttft_ms"]), fmt(s["short_ttft_ms"]), times(q["short_ttft"])],
                ["short total ms (median)", fmt(a["short_total_ms"]), fmt(s["short_total_ms"]),
                 times(q["short_total"])],
                ["short ITL ms p50 / p99", f"{fmt(a['short_itl_p50_ms'])} / {fmt(a['short_itl_p99_ms'])}",
                 f"{fmt(s['short_itl_p50_ms'])} / {fmt(s['short_itl_p99_ms'])}", times(q["short_itl_p99"])],
                ["long TTFT ms", fmt(b["long_alone_ttft_ms"]), fmt(b["long_ttft_ms"]), times(q["long_ttft"])]]
        out.append((f"beside-long: {r['num_short']} x {r['short_len']}/{r['output_len']} sent {r['lead_ms']:g} ms "
                    f"after one {r['long_len_used']}-token prompt",
                    (["", "alone", "beside the long", "ratio"], rows)))
    if m := r.get("mixed"):
        out.append((f"mixed: Poisson {m['rate']:g} req/s for {r['duration']:g} s, {r['long_fraction']:.0%} long",
                    load_table([m])))
    if g := r.get("goodput"):
        out.append((f"goodput: short good when TTFT <= {r['short_ttft_ms']:g} ms and mean TPOT <= "
                    f"{r['short_tpot_ms']:g} ms, long when TTFT <= {r['long_ttft_ms']:g} ms; peak "
                    f"{g['peak_good_per_s']:.1f} good req/s", load_table(g["points"])))
    return out


def load_table(points: list[dict]) -> Table:
    head = ["rate", "short TTFT p50 / p99 ms", "short ITL p99 ms", "long TTFT p50 ms", "good req/s", "failed"]
    rows = [[f"{p['rate']:g}", f"{fmt(p['short_ttft_p50_ms'])} / {fmt(p['short_ttft_p99_ms'])}",
             fmt(p["short_itl_p99_ms"]), fmt(p["long_ttft_p50_ms"]),
             f"{p['good_per_s']:.1f} ({p['good_fraction']:.0%})", str(p["failed"])] for p in points]
    return head, rows


def format_scenarios(r: dict) -> str:
    out = [f"{' Flat-latency scenarios ':=^78}", f"server {r['base_url']}, model {r['model_id']}, "
           f"context {fmt(r['max_model_len'])}, prompt lengths: {r['prompt_lengths']}"]
    out += [f"notice: {n}" for n in r.get("notices", [])]
    for title, table in scenario_tables(r):
        out += ["", title, text_table(table)]
    out.append("=" * 78)
    return "\n".join(out)


def write_chart(r: dict, path: str | Path, title: str = "") -> Path:
    """One PNG: short TTFT and total time alone/beside/mixed, long TTFT, goodput by rate."""
    from matplotlib.figure import Figure

    from expresslane.bench.report import figure_png

    panels = [p for p in ("beside_long", "mixed", "goodput", "isolated") if r.get(p)]
    fig = Figure(figsize=(5 * max(1, len(panels)), 4), layout="constrained")
    axes = fig.subplots(1, max(1, len(panels)), squeeze=False)[0]
    for ax, panel in zip(axes, panels):
        if panel == "beside_long":
            b = r[panel]
            labels = ["short TTFT", "short total", "long TTFT"]
            alone = [b["alone"]["short_ttft_ms"], b["alone"]["short_total_ms"], b["long_alone_ttft_ms"]]
            beside = [b["beside"]["short_ttft_ms"], b["beside"]["short_total_ms"], b["long_ttft_ms"]]
            xs = range(len(labels))
            ax.bar([x - 0.2 for x in xs], [v or 0 for v in alone], 0.4, label="alone")
            ax.bar([x + 0.2 for x in xs], [v or 0 for v in beside], 0.4, label="beside the long prompt")
            ax.set_xticks(list(xs), labels)
            ax.set_ylabel("ms (median)")
            ax.set_title("beside a long prompt")
            ax.legend()
        elif panel == "mixed":
            m = r[panel]
            labels = ["short TTFT p50", "short TTFT p99", "short ITL p99", "long TTFT p50"]
            ax.bar(labels, [m["short_ttft_p50_ms"] or 0, m["short_ttft_p99_ms"] or 0, m["short_itl_p99_ms"] or 0,
                            m["long_ttft_p50_ms"] or 0])
            ax.set_ylabel("ms")
            ax.set_title(f"mixed load, {m['rate']:g} req/s")
            ax.tick_params(axis="x", labelrotation=20)
        elif panel == "goodput":
            pts = r[panel]["points"]
            ax.plot([p["rate"] for p in pts], [p["good_per_s"] for p in pts], "o-", label="good req/s")
            ax.plot([p["rate"] for p in pts], [p["rate"] for p in pts], ":", color="grey", label="offered")
            ax.set_xlabel("offered req/s")
            ax.set_ylabel("good req/s")
            ax.set_title("goodput under the SLO")
            ax.legend()
        else:
            iso = r[panel]["ttft_ms"]
            ax.plot([int(n) for n in iso], [v or 0 for v in iso.values()], "o-")
            ax.set_xlabel("prompt tokens")
            ax.set_ylabel("TTFT ms")
            ax.set_title("isolated TTFT by length")
    if title:
        fig.suptitle(title)
    out = Path(path)
    out.write_bytes(figure_png(fig))
    return out
