"""Issue #20's acceptance measurements through HTTP, with the project's bench, for one or more
`expresslane serve` configurations started back to back on this machine.

    python benchmarks/flat_acceptance.py --model DIR --dtype bfloat16 \
        --config default= --config fcfs=--scheduling-policy=fcfs --out results.jsonl

Per configuration: a fresh server (`expresslane serve MODEL --dtype D` plus the
configuration's flags), then `bench doctor`'s measurements (isolated TTFT by length and
batch-1 ITL, 16 shorts beside one long prompt, Poisson mixed load, the engine's own TTFT
of the long prompt from its timestamps), the goodput sweep, and the throughput run (256
requests of 512 in / 256 out at once, `bench serving`). One JSON line per configuration;
a compact table with the issue's bars last.
"""

from __future__ import annotations

import argparse
import json
import os
import urllib.request
from dataclasses import replace

from _shared import emit, start_server, stop_server

from expresslane.bench.client import ClientOptions
from expresslane.bench.datasets import DatasetSpec
from expresslane.bench.doctor import DoctorConfig, run_doctor
from expresslane.bench.scenarios import ScenarioConfig, run_scenarios
from expresslane.bench.serving import ServingConfig, run_serving


def step_times(url: str) -> dict:
    """The engine's step-cost model (/load) and its mean measured vs predicted step time so far
    (/metrics): how well the model the scheduler sizes steps with fits this machine."""
    with urllib.request.urlopen(url + "/load", timeout=5) as r:
        step_cost = json.load(r).get("step_cost")
    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    sums = {}
    for line in text.splitlines():
        for name in ("step_time_seconds", "step_time_predicted_seconds"):
            for part in ("sum", "count"):
                if line.startswith(f"expresslane:{name}_{part}"):
                    sums[f"{name}_{part}"] = float(line.rsplit(" ", 1)[1])
    mean = {name: 1e3 * sums[f"{name}_sum"] / sums[f"{name}_count"]
            for name in ("step_time_seconds", "step_time_predicted_seconds") if sums.get(f"{name}_count")}
    return {"step_cost": step_cost, "step_ms_mean": mean.get("step_time_seconds"),
            "step_ms_predicted_mean": mean.get("step_time_predicted_seconds")}


def measure(url: str, args: argparse.Namespace) -> dict:
    opts = ClientOptions(base_url=url)
    sc = ScenarioConfig(client=opts, duration=args.duration, sweep_duration=args.sweep_duration,
                        rates=tuple(args.rates), repeats=args.repeats)
    doc = run_doctor(DoctorConfig(sc))
    sweep = run_scenarios(replace(sc, run=("goodput",)))["goodput"]
    tput = run_serving(ServingConfig(client=replace(opts, ignore_eos=True), alone_probes=0, disable_tqdm=True,
                                     dataset=DatasetSpec("random", args.num_prompts, 512, 256)))
    iso, b, m, split = doc["isolated"], doc["beside_long"], doc["mixed"], doc["engine_split"] or {}
    long_key, short_key = str(doc["long_len_used"]), str(min(int(n) for n in iso["ttft_ms"]))
    engine_long = (split.get(long_key) or {}).get("engine_ttft_ms")
    short_iso = iso["ttft_ms"].get(short_key)
    return {
        "short_ttft_ratio": b["ratios"]["short_ttft"], "short_total_ratio": b["ratios"]["short_total"],
        "long_ttft_ratio": b["ratios"]["long_ttft"], "short_ttft_alone_ms": b["alone"]["short_ttft_ms"],
        "short_ttft_beside_ms": b["beside"]["short_ttft_ms"], "long_ttft_beside_ms": b["long_ttft_ms"],
        "mixed_short_ttft_p99_ms": m["short_ttft_p99_ms"], "mixed_short_ttft_p50_ms": m["short_ttft_p50_ms"],
        "mixed_p99_vs_isolated": m["short_ttft_p99_ms"] / short_iso if m["short_ttft_p99_ms"] and short_iso else None,
        "mixed_short_itl_p99_ms": m["short_itl_p99_ms"], "batch1_itl_ms": iso["batch1_itl_ms"],
        "mixed_itl_p99_vs_batch1": (m["short_itl_p99_ms"] / iso["batch1_itl_ms"]
                                    if m["short_itl_p99_ms"] and iso["batch1_itl_ms"] else None),
        "mixed_long_ttft_p50_ms": m["long_ttft_p50_ms"], "mixed_failed": m["failed"],
        "goodput": [{k: p[k] for k in ("rate", "good_per_s", "good_fraction", "failed")} for p in sweep["points"]],
        "peak_good_per_s": sweep["peak_good_per_s"],
        "isolated_ttft_ms": iso["ttft_ms"], "engine_ttft_long_ms": engine_long,
        "http_vs_engine_long": iso["ttft_ms"].get(long_key) / engine_long if engine_long else None,
        "output_tok_per_s": tput["output_throughput"], "throughput_failed": tput["failed"],
        "batch1_decode_tok_per_s": 1000 / iso["batch1_itl_ms"] if iso["batch1_itl_ms"] else None,
        "diagnosis": [c["cause"] for c in doc["diagnosis"]["causes"]], "doctor_flags": doc["diagnosis"]["flags"],
        **step_times(url),
    }


BARS = [  # (key, label, bar, lower is better)
    ("short_ttft_ratio", "16 shorts beside 8k: short TTFT / alone", 1.1, True),
    ("short_total_ratio", "  short total time / alone", 1.2, True),
    ("long_ttft_ratio", "  long TTFT / alone", 1.5, True),
    ("mixed_short_ttft_p99_ms", "mixed 8 req/s: short TTFT p99 ms", 40.0, True),
    ("mixed_p99_vs_isolated", "  short TTFT p99 / isolated", 2.0, True),
    ("mixed_itl_p99_vs_batch1", "  short ITL p99 / batch-1 ITL", 2.0, True),
    ("mixed_long_ttft_p50_ms", "  long TTFT p50 ms", 300.0, True),
    ("peak_good_per_s", "goodput peak req/s", 21.0, False),
    ("http_vs_engine_long", "8k TTFT through HTTP / in-engine", 1.05, True),
    ("output_tok_per_s", "throughput 256 x 512/256, out tok/s", 9500.0, False),
    ("batch1_decode_tok_per_s", "batch-1 decode tok/s", 215.0, False),
]


def table(rows: dict[str, dict]) -> str:
    names = list(rows)
    out = [f"{'':42}" + "".join(f"{n:>14}" for n in names) + f"{'bar':>10}"]
    for key, label, bar, lower in BARS:
        cells = ""
        for n in names:
            v = rows[n].get(key)
            ok = v is not None and (v <= bar if lower else v >= bar)
            cells += f"{'-' if v is None else f'{v:.2f}':>12}{'ok' if ok else '  ':>2}"
        out.append(f"{label:42}{cells}{('<=' if lower else '>=') + f'{bar:g}':>10}")
    for n in names:
        good = ", ".join(f"{p['rate']:g}: {p['good_per_s']:.1f} ({p['good_fraction']:.0%})" for p in rows[n]["goodput"])
        if rows[n].get("step_ms_mean"):
            out.append(f"{n}: mean step {rows[n]['step_ms_mean']:.2f} ms measured, "
                       f"{rows[n]['step_ms_predicted_mean']:.2f} ms predicted by the step-cost model")
        out.append(f"{n}: goodput by rate {good}; doctor: {', '.join(rows[n]['diagnosis']) or 'flat'}"
                   + (f" -> {' '.join(rows[n]['doctor_flags'])}" if rows[n]["doctor_flags"] else ""))
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--config", action="append", required=True, metavar="NAME=FLAGS",
                   help="a server configuration: its name and flags (spaces or '=' between a flag and its value)")
    p.add_argument("--duration", type=float, default=20.0, help="mixed load seconds")
    p.add_argument("--sweep-duration", type=float, default=15.0)
    p.add_argument("--rates", type=float, nargs="+", default=[8.0, 16.0, 24.0, 32.0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=256, help="throughput run: requests of 512 in / 256 out")
    p.add_argument("--logs", default=".")
    p.add_argument("--out")
    args = p.parse_args()
    rows = {}
    for item in args.config:
        name, _, flags = item.partition("=")
        flag_list = [x for f in flags.split() for x in f.split("=", 1)]
        proc, url = start_server([args.model, "--dtype", args.dtype, *flag_list],
                                 os.path.join(args.logs, f"serve-{name}.log"), timeout=300)
        try:
            rows[name] = measure(url, args)
        finally:
            stop_server(proc)
        emit(args.out, bench="flat_acceptance", config=name, flags=flag_list, **rows[name])
    print(table(rows))


if __name__ == "__main__":
    main()
