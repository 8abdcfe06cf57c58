"""Data parallelism through the router (issue #13): `expresslane serve MODEL
--data-parallel-size N` (N replicas, one GPU each, the router in front) against one replica,
started back to back, measured through HTTP with the project's bench:

- throughput: 256 requests of 512 random tokens in / 256 out at once (`bench serving`),
  output tokens/s; DP=N over DP=1 (issue #13's bar: >= 1.9x at N = 2);
- flatness: 16 shorts (64 in / 64 out) sent 5 ms after one 8192-token prompt
  (`bench scenarios --run beside-long`): short TTFT, short total time and the long prompt's
  TTFT, each beside the long prompt over alone.

    python benchmarks/dp_bench.py --model DIR [--dp 2] [--dtype bfloat16] [--out results.jsonl]

Needs N GPUs (each replica takes the next one; CUDA_VISIBLE_DEVICES as the router sets it).
"""

from __future__ import annotations

import argparse
import json
import os
import time
import urllib.request
from dataclasses import replace

from _shared import emit, start_server, stop_server

from expresslane.bench.client import ClientOptions
from expresslane.bench.datasets import DatasetSpec
from expresslane.bench.scenarios import ScenarioConfig, run_scenarios
from expresslane.bench.serving import ServingConfig, run_serving


def wait_for_replicas(url: str, timeout: float = 900.0) -> None:
    """The router answers once one replica is up: wait until every one is (a plain server: at once)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            replicas = json.load(r).get("replicas")
        if not replicas or "down" not in replicas.values():
            return
        time.sleep(1.0)
    raise TimeoutError(f"replicas still down after {timeout:.0f} s: {replicas}")


def measure(url: str, num_prompts: int) -> dict:
    opts = ClientOptions(base_url=url)
    tput = run_serving(ServingConfig(client=replace(opts, ignore_eos=True), alone_probes=0, disable_tqdm=True,
                                     dataset=DatasetSpec("random", num_prompts, 512, 256)))
    beside = run_scenarios(ScenarioConfig(client=opts, run=("beside-long",)))["beside_long"]
    return {"output_tok_per_s": tput["output_throughput"], "throughput_failed": tput["failed"],
            "short_ttft_ratio": beside["ratios"]["short_ttft"], "short_total_ratio": beside["ratios"]["short_total"],
            "long_ttft_ratio": beside["ratios"]["long_ttft"], "short_ttft_alone_ms": beside["alone"]["short_ttft_ms"],
            "short_ttft_beside_ms": beside["beside"]["short_ttft_ms"], "long_ttft_beside_ms": beside["long_ttft_ms"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--logs", default=".")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = {}
    for dp in (1, args.dp):
        proc, url = start_server([args.model, "--dtype", args.dtype, "--data-parallel-size", str(dp)],
                                 os.path.join(args.logs, f"serve-dp{dp}.log"), timeout=900)
        try:
            wait_for_replicas(url)
            rows[dp] = measure(url, args.num_prompts)
        finally:
            stop_server(proc)
        emit(args.out, bench="dp_router", dp=dp, **rows[dp])
    one, many = rows[1], rows[args.dp]
    emit(args.out, bench="dp_speedup", dp=args.dp,
         throughput_ratio=many["output_tok_per_s"] / one["output_tok_per_s"] if one["output_tok_per_s"] else None)


if __name__ == "__main__":
    main()
