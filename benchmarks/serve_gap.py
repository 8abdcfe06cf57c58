"""Where the server loses against the engine: issue #20's isolated TTFT-128 (bar ≤ 7 ms through
HTTP) and its throughput run (256 × 512 in / 256 out at once, bar ≥ 9,500 output tok/s).

    python benchmarks/serve_gap.py --model DIR --dtype bfloat16 --config default= \
        --config fcfs=--scheduling-policy=fcfs --out results.jsonl

Per configuration, a fresh `expresslane serve`:
- `bench server-overhead` at 128 prompt tokens (one output token), sequential: HTTP TTFT, the
  engine's own TTFT (its timestamps), and the rest split into "in" (sent -> engine took it)
  and "out" (first token -> client);
- the throughput run through HTTP, with the engine's /metrics read before and after: steps,
  tokens per step, the sum of back-to-back step times (the GPU's busy time, as the engine saw
  it) against the run's wall time;
then the same throughput run in-engine (`bench throughput`, the same flags, random prompts).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import replace

from _shared import emit, start_server, stop_server

from expresslane.bench.client import ClientOptions
from expresslane.bench.datasets import DatasetSpec
from expresslane.bench.overhead import run_overhead
from expresslane.bench.serving import ServingConfig, run_serving
from expresslane.config.bench import OverheadConfig

SUMS = ("step_time_seconds", "step_duration_seconds", "iteration_tokens_total", "batch_size")


def engine_sums(url: str) -> dict[str, float]:
    """Sum and count of the engine's per-step histograms, from /metrics."""
    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for name in SUMS:
        for part in ("sum", "count"):
            m = re.search(rf"^expresslane:{name}_{part}{{[^}}]*}} (\S+)$", text, re.MULTILINE)
            out[f"{name}_{part}"] = float(m.group(1)) if m else 0.0
    return out


def over_http(url: str, num_prompts: int) -> dict:
    opts = ClientOptions(base_url=url)
    ov = run_overhead(OverheadConfig(client=opts, sequential=60, concurrency=1, rounds=1, warmup=10,
                                     prompt_len=128, disable_tqdm=True))["sequential"]
    before, t0 = engine_sums(url), time.monotonic()
    tput = run_serving(ServingConfig(client=replace(opts, ignore_eos=True), alone_probes=0, disable_tqdm=True,
                                     dataset=DatasetSpec("random", num_prompts, 512, 256)))
    wall = time.monotonic() - t0
    after = engine_sums(url)
    d = {k: after[k] - before[k] for k in after}
    steps = d["iteration_tokens_total_count"] or 1
    return {
        **{f"{p}_p50_ms": ov[p]["p50"] for p in ("http_ttft", "engine_ttft", "overhead", "in", "out")
           if ov.get(p)},
        "tput_out_tok_per_s": tput["output_throughput"], "tput_failed": tput["failed"],
        "tput_duration_s": tput.get("duration"), "tput_wall_s": wall,
        "steps": int(d["iteration_tokens_total_count"]), "tokens_per_step": d["iteration_tokens_total_sum"] / steps,
        "seqs_per_step": d["batch_size_sum"] / steps,
        "back_to_back_steps": int(d["step_time_seconds_count"]), "gpu_busy_s": d["step_time_seconds_sum"],
        "step_call_s": d["step_duration_seconds_sum"],
    }


def in_engine(model: str, dtype: str, flags: list[str], num_prompts: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "t.json")
        subprocess.run([sys.executable, "-m", "expresslane.cli.main", "bench", "throughput", model, "--dtype", dtype,
                        "--num-prompts", str(num_prompts), "--input-len", "512", "--output-len", "256",
                        "--no-baseline", "--output", path, *flags], check=True)
        with open(path) as f:
            res = json.load(f)
    row = next(r for r in res["rows"] if r["engine"] == "expresslane")
    return {"engine_out_tok_per_s": row["tokens_per_s"], "engine_seconds": row["seconds"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--config", action="append", required=True, help="NAME=FLAGS ('=' or spaces inside FLAGS)")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--logs", default=".")
    p.add_argument("--out")
    args = p.parse_args()
    for spec in args.config:
        name, _, flags = spec.partition("=")
        flag_list = [part for f in shlex.split(flags) for part in f.split("=", 1)]
        proc, url = start_server([args.model, "--dtype", args.dtype, *flag_list],
                                 os.path.join(args.logs, f"serve-gap-{name}.log"), timeout=300)
        try:
            http = over_http(url, args.num_prompts)
        finally:
            stop_server(proc)
        emit(args.out, bench="serve_gap", config=name, flags=flag_list, **http,
             **in_engine(args.model, args.dtype, flag_list, args.num_prompts))


if __name__ == "__main__":
    main()
