"""Tables of a result as rows of strings, shared by the console and the HTML report."""

from __future__ import annotations

import sys

from expresslane.bench.records import first_errors
from expresslane.bench.stats import METRICS

TITLES = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
          "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
SHOWN_STATS = ("mean", "median", "p90", "p99")
# How the load was offered; each result kind has some of these keys.
LOAD_ROWS = (("request_rate", "Request rate (req/s)"), ("max_concurrency", "Max concurrency"),
             ("num_users", "Users"), ("think_time", "Mean think time (s)"))
CONSOLE_TITLES = {"serving": "Serving Benchmark Result", "traffic": "Traffic Simulation Result"}
Table = tuple[list[str], list[list[str]]]


def notify(line: str) -> None:
    """A notice about how the run is measured (a capped prompt, estimated lengths...)."""
    print(f"notice: {line}", file=sys.stderr, flush=True)


def error_lines(r: dict, limit: int = 5) -> list[str]:
    """The first distinct error messages of failed requests, with how often each came."""
    return [f"x{n}  {msg}" for msg, n in first_errors(r.get("errors") or [], limit)]


def fmt(x: object) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.2f}"
    return str(x)


def headline_rows(r: dict) -> list[tuple[str, str]]:
    rows = [("Successful requests", fmt(r["completed"])), ("Failed requests", fmt(r["failed"]))]
    rows += [(f"  {kind}", fmt(n)) for kind, n in r["failure_reasons"].items()]
    rows += [(label, fmt(r[key])) for key, label in LOAD_ROWS if key in r]
    rows += [("Benchmark duration (s)", fmt(r["duration"])),
             ("Total input tokens", fmt(r["total_input_tokens"])),
             ("Total generated tokens", fmt(r["total_output_tokens"])),
             ("Request throughput (req/s)", fmt(r["request_throughput"]))]
    if r.get("request_goodput") is not None:
        rows.append(("Request goodput (req/s)", fmt(r["request_goodput"])))
    rows += [("Output token throughput (tok/s)", fmt(r["output_throughput"])),
             ("Total token throughput (tok/s)", fmt(r["total_token_throughput"]))]
    if r.get("alone_ttft_ms") is not None:
        rows.append(("TTFT of a short prompt alone (ms)", fmt(r["alone_ttft_ms"])))
    return rows


def latency_table(r: dict) -> Table:
    header = ["metric"] + [f"{s} (ms)" for s in SHOWN_STATS]
    return header, [[m.upper()] + [fmt(r[f"{s}_{m}_ms"]) for s in SHOWN_STATS] for m in METRICS]


def class_table(r: dict) -> Table:
    header = ["class", "completed", "failed", "mean TTFT", "p99 TTFT", "mean TPOT",
              "mean ITL", "mean E2E", "p99 E2E"]
    keys = ["mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "mean_itl_ms", "mean_e2el_ms",
            "p99_e2el_ms"]
    rows = [[name, fmt(c["completed"]), fmt(c["failed"])] + [fmt(c[k]) for k in keys]
            for name, c in r["per_class"].items()]
    return header, rows


def slo_table(r: dict) -> Table:
    verdict = {True: "PASS", False: "FAIL", None: "N/A"}
    rows = [[verdict[i["passed"]], i["metric"], f"{i['op']} {i['target']:g}", fmt(i["value"]),
             i["note"]] for i in r["slo"]["items"]]
    return ["verdict", "metric", "target", "value", "note"], rows


def cause_lines(r: dict) -> list[str]:
    lines = []
    for c in r["slo"]["causes"]:
        lines.append(f"{c['cause']}: {c['evidence']}")
        lines += [f"    -> {flag}" for flag in c["flags"]]
    return lines


def sweep_table(sweep: dict) -> Table:
    header = [sweep["variable"], "req/s", "output tok/s", "failed", "mean TTFT", "p99 TTFT",
              "mean TPOT", "p99 E2E", "SLO"]
    rows = [[f"{v:g}", fmt(p["request_throughput"]), fmt(p["output_throughput"]),
             fmt(p["failed"]), fmt(p["mean_ttft_ms"]), fmt(p["p99_ttft_ms"]),
             fmt(p["mean_tpot_ms"]), fmt(p["p99_e2el_ms"]),
             "PASS" if p["slo"]["passed"] else "FAIL"]
            for v, p in zip(sweep["values"], sweep["results"])]
    return header, rows


COMPARED = ("request_throughput", "output_throughput", "mean_ttft_ms", "p99_ttft_ms",
            "mean_tpot_ms", "mean_itl_ms", "mean_e2el_ms", "p99_e2el_ms", "failed")


def compare_table(results: list[dict], labels: list[str]) -> Table:
    """Key metrics side by side, with each result's ratio to the first (the baseline)."""
    header = ["metric"] + labels[:1] + [f"{lb} (x {labels[0]})" for lb in labels[1:]]
    rows = []
    for key in COMPARED:
        base = results[0][key]
        cells = [fmt(base)] + [f"{fmt(r[key])} ({r[key] / base:.2f}x)" if base else fmt(r[key])
                               for r in results[1:]]
        rows.append([key] + cells)
    return header, rows


def verdict_text(r: dict) -> str:
    """PASS, or FAIL with the targets missed."""
    if r["slo"]["passed"]:
        return "SLO PASS"
    missed = [f"{i['metric']} {fmt(i['value'])} (target {i['op']} {i['target']:g})"
              for i in r["slo"]["items"] if i["passed"] is False]
    return "SLO FAIL: " + ", ".join(missed)


def run_summary(label: str, r: dict) -> list[str]:
    """A result in a few lines: what ran, against what, how many failed, the verdict."""
    kind = r["kind"]
    if kind == "sweep":
        pts = r["results"]
        first = run_summary(label, pts[0])[0].split(": ", 1)[1] if pts else ""
        sat = (f"past saturation at {r['variable']}={r['saturated_at']:g} ({r['saturation_reason']})"
               if r["saturated_at"] is not None else "not saturated")
        verdicts = ", ".join(f"{v:g}: {'PASS' if p['slo']['passed'] else 'FAIL'}"
                             for v, p in zip(r["values"], pts))
        return [f"{label}: sweep of {r['variable']} over {', '.join(f'{v:g}' for v in r['values'])}; {sat}",
                f"    {first}",
                f"    {sum(p['failed'] for p in pts)} of {sum(p['failed'] + p['completed'] for p in pts)} "
                f"requests failed; SLO per point: {verdicts}"]
    if kind == "flat-latency":
        where = r.get("base_url") or f"in-process {r['device']} {r['dtype']}"
        flat = ", ".join(f"{row['mode']} {fmt(row['flatness'])}x" for row in r["rows"])
        failed = sum(row["failed"] for row in r["rows"])
        return [f"{label}: flat-latency, model {r['model_id']} ({where}); {r['num_short']} x "
                f"{r['short_len']}-token prompts with one of {r['long_len']}, {r['output_len']} "
                f"output tokens, median of {r['repeats']}",
                f"    {failed} requests failed; flatness (short TTFT mixed / alone): {flat}"]
    if kind == "one-batch":
        return [f"{label}: one-batch, model {r['model_id']} ({r['device']}, {r['dtype']}); batch "
                f"{r['batch_size']} x input {r['input_len']} x output {r['output_len']}",
                f"    prefill {fmt(r['prefill_latency_ms'])} ms, median decode step "
                f"{fmt(r['median_decode_step_ms'])} ms, {fmt(r['decode_throughput'])} tokens/s"]
    if kind == "throughput":
        rates = ", ".join(f"{row['engine']} {fmt(row['tokens_per_s'])} tok/s" for row in r["rows"])
        return [f"{label}: throughput, model {r['model_id']} ({r['device']}, {r['dtype']}); "
                f"{r['num_prompts']} prompts x {r['input_len']} -> {r['output_len']} tokens",
                f"    {rates}"]
    if kind == "server-overhead":
        seq, conc = r["sequential"], r["concurrent"]
        over = [f"{name} p50 {fmt((s['overhead'] or {}).get('p50'))} ms" for name, s in
                (("sequential", seq), (f"{conc['concurrency']} streams", conc))]
        return [f"{label}: server-overhead, model {r['model_id']} at {r['base_url']}",
                f"    {seq['failed'] + conc['failed']} of {seq['requests'] + conc['requests']} requests "
                f"failed; overhead {', '.join(over)}"]
    load = (f"{r['num_users']} users, think {fmt(r['think_time'])} s" if kind == "traffic" else
            f"dataset {r['dataset']}, {r['num_prompts']} prompts, rate {r['request_rate']} req/s, "
            f"concurrency {fmt(r['max_concurrency'])}")
    total = r["completed"] + r["failed"]
    return [f"{label}: {kind}, model {r['model_id']} at {r['endpoint']}; {load}",
            f"    {r['failed']} of {total} requests failed; {verdict_text(r)}"]


def text_table(table: Table) -> str:
    header, rows = table
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)


def format_console(r: dict) -> str:
    """vLLM-style summary of a result, then its classes and SLO verdict."""
    title = CONSOLE_TITLES.get(r["kind"], f"{r['kind']} result")
    out = [f"{' ' + title + ' ':=^60}"]
    out += [f"{label + ':':<44}{value:>16}" for label, value in headline_rows(r)]
    if r.get("prompt_lengths"):
        out.append(f"Prompt lengths: {r['prompt_lengths']}")
    out += [f"Notice: {line}" for line in r.get("notices") or []]
    if errors := error_lines(r):
        out += [f"{' Errors (first distinct messages) ':-^60}"] + errors
    for m in METRICS:
        out.append(f"{' ' + TITLES[m] + ' ':-^60}")
        out += [f"{f'{s.capitalize()} {m.upper()} (ms):':<44}{r[f'{s}_{m}_ms']:>16.2f}"
                for s in SHOWN_STATS]
    out += [f"{' Per class ':-^60}", text_table(class_table(r))]
    verdict = "PASS" if r["slo"]["passed"] else "FAIL"
    out += [f"{' SLO: ' + verdict + ' ':-^60}", text_table(slo_table(r))]
    if r["slo"]["causes"]:
        out += ["Likely causes:"] + [f"  {line}" for line in cause_lines(r)]
    out.append("=" * 60)
    return "\n".join(out)
