"""Reports from result JSON files: one self-contained HTML page, or one PNG of charts.

Every result kind the bench writes is reported: serving, sweep, traffic, flat-latency,
one-batch, throughput and server-overhead. The HTML page holds every table of every
result (summary, latency, per class, SLO verdict with causes, sweep points; the other
kinds' tables as their runs print them) and the charts as base64 PNGs, so it can be mailed or attached
as it is. The PNG opens with a title and, per result, its configuration, failure count
and SLO verdict. ``compare`` adds a table of key metrics side by side, as ratios to the
first result (serving, traffic and sweep points). Charts overlay all given results.
"""

from __future__ import annotations

import base64
import html
import io
from pathlib import Path

from matplotlib.figure import Figure  # the OO API: no pyplot state, renders with Agg

from expresslane.bench import charts, tables
from expresslane.bench.charts import Labelled
from expresslane.bench.records import load_result

CSS = """body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1200px;color:#222}
table{border-collapse:collapse;margin:0.5em 0 1.5em}td,th{border:1px solid #ccc;
padding:3px 8px;text-align:right}th{background:#f0f0f0}td:first-child{text-align:left}
.pass{color:#080;font-weight:bold}.fail{color:#b00;font-weight:bold}
figure{display:inline-block;margin:0.5em}img{max-width:560px}"""

REPORTED = ("serving", "sweep", "traffic", "flat-latency", "one-batch", "throughput", "server-overhead")
PRINTED = ("flat-latency", "one-batch", "throughput", "server-overhead")  # shown as their runs print
TITLE = "expresslane bench report"


def load_labelled(paths: list[str], labels: list[str] | None = None) -> Labelled:
    if labels and len(labels) != len(paths):
        raise ValueError(f"got {len(labels)} labels for {len(paths)} results")
    names = labels or [Path(p).stem for p in paths]
    if len(set(names)) < len(names):  # same file names in different folders
        names = [f"{i + 1}:{n}" for i, n in enumerate(names)]
    results = [(name, load_result(p)) for name, p in zip(names, paths)]
    for p, (_, r) in zip(paths, results):
        if r["kind"] not in REPORTED:
            raise ValueError(f"{p}: a {r['kind']} result; the report covers "
                             f"{', '.join(REPORTED)} results")
    return results


def figure_png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return buf.getvalue()


def chart_png(chart: charts.Chart, results: Labelled) -> bytes:
    fig = Figure(figsize=(6.4, 4.4), layout="constrained")
    charts.draw(chart, fig.add_subplot(), results)
    return figure_png(fig)


def grid_png(results: Labelled) -> bytes:
    """A header (title; per result its configuration, failures and verdict), then every
    applicable chart, two per row."""
    todo = charts.applicable(results)
    lines = [line for label, r in results for line in tables.run_summary(label, r)]
    head = 0.6 + 0.22 * len(lines)
    rows = (len(todo) + 1) // 2
    fig = Figure(figsize=(13, head + 4.4 * rows), layout="constrained")
    top, body = fig.subfigures(2, 1, height_ratios=[head, 4.4 * max(rows, 1)])
    top.suptitle(TITLE, fontsize=15, fontweight="bold")
    top.text(0.01, 0.98 - 0.6 / head, "\n".join(lines), va="top", ha="left", family="monospace",
             fontsize=9, color="black")
    for i, chart in enumerate(todo):
        charts.draw(chart, body.add_subplot(rows, 2, i + 1), results)
    return figure_png(fig)


def html_table(table: tables.Table) -> str:
    header, rows = table
    cls = {"PASS": ' class="pass"', "FAIL": ' class="fail"'}
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td{cls.get(c, '')}>{html.escape(c)}</td>" for c in row)
                   + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def result_section(label: str, r: dict) -> str:
    parts = [f"<h3>{html.escape(label)}</h3>",
             f"<p>{html.escape(r['kind'])} against {html.escape(r['endpoint'])}, model "
             f"{html.escape(str(r['model_id']))}, {html.escape(r['date'])}; prompt lengths: "
             f"{html.escape(str(r.get('prompt_lengths')))}</p>",
             *[f"<p>notice: {html.escape(n)}</p>" for n in r.get("notices") or []],
             html_table((["summary", ""], [list(row) for row in tables.headline_rows(r)])),
             html_table(tables.latency_table(r)),
             html_table(tables.class_table(r))]
    verdict = "PASS" if r["slo"]["passed"] else "FAIL"
    parts += [f'<p>SLO: <span class="{verdict.lower()}">{verdict}</span></p>',
              html_table(tables.slo_table(r))]
    if errors := tables.error_lines(r):
        parts.append("<p>Errors (first distinct messages):</p><pre>"
                     + html.escape("\n".join(errors)) + "</pre>")
    if r["slo"]["causes"]:
        items = "".join(
            f"<li><b>{html.escape(c['cause'])}</b>: {html.escape(c['evidence'])}<ul>"
            + "".join(f"<li>{html.escape(flag)}</li>" for flag in c["flags"]) + "</ul></li>"
            for c in r["slo"]["causes"])
        parts.append(f"<p>Likely causes:</p><ul>{items}</ul>")
    return "\n".join(parts)


def sweep_section(label: str, s: dict) -> str:
    verdict = (f"past saturation at {s['variable']}={s['saturated_at']:g}: "
               f"{s['saturation_reason']}" if s["saturated_at"] is not None
               else "not saturated within the sweep")
    parts = [f"<h3>{html.escape(label)} (sweep over {html.escape(s['variable'])})</h3>",
             f"<p>{html.escape(verdict)}</p>", html_table(tables.sweep_table(s))]
    for value, point in zip(s["values"], s["results"]):
        parts.append(result_section(f"{label} {s['variable']}={value:g}", point))
    return "\n".join(parts)


def printed_section(label: str, r: dict) -> str:
    """The tables the run printed (flat-latency, one-batch, throughput, server-overhead)."""
    if r["kind"] == "flat-latency":
        from expresslane.bench.flat_latency import format_flat_latency as show
    elif r["kind"] == "one-batch":
        from expresslane.bench.one_batch import format_one_batch as show
    elif r["kind"] == "throughput":
        from expresslane.bench.throughput import format_throughput as show
    else:
        from expresslane.bench.overhead import format_overhead as show
    return f"<h3>{html.escape(label)}</h3><pre>{html.escape(show(r))}</pre>"


def section(label: str, r: dict) -> str:
    if r["kind"] == "sweep":
        return sweep_section(label, r)
    if r["kind"] in PRINTED:
        return printed_section(label, r)
    return result_section(label, r)


def html_page(results: Labelled, compare: bool) -> str:
    summary = "\n".join(line for label, r in results for line in tables.run_summary(label, r))
    body = [f"<h1>{TITLE}</h1>", f"<pre>{html.escape(summary)}</pre>"]
    pts = charts.points(results)
    if compare and len(pts) > 1:
        body += ["<h2>Comparison</h2>",
                 html_table(tables.compare_table([r for _, r in pts], [lb for lb, _ in pts]))]
    body.append("<h2>Results</h2>")
    body += [section(lb, r) for lb, r in results]
    body.append("<h2>Charts</h2>")
    for chart in charts.applicable(results):
        data = base64.b64encode(chart_png(chart, results)).decode("ascii")
        body.append(f'<figure><img alt="{html.escape(chart.title)}" '
                    f'src="data:image/png;base64,{data}"><figcaption>'
                    f"{html.escape(chart.title)}</figcaption></figure>")
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>expresslane bench "
            f"report</title><style>{CSS}</style></head><body>{''.join(body)}</body></html>")


def write_report(paths: list[str], output: str, compare: bool, labels: list[str] | None) -> Path:
    """Write ``output`` (.html or .png) from result files; returns its path."""
    out = Path(output)
    if out.suffix not in (".html", ".png"):
        raise ValueError(f"report output must end in .html or .png, got {output!r}")
    results = load_labelled(paths, labels)
    if out.suffix == ".png":
        out.write_bytes(grid_png(results))
    else:
        out.write_text(html_page(results, compare))
    return out
