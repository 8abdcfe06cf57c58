"""Issue #18's long-context figures through HTTP, as the issue measured them: one
`expresslane serve MODEL --dtype D --max-model-len 33792` (a 33k context), then each
prompt length sent alone (`bench scenarios --run isolated`, one length at a time): TTFT of
a 16k and a 32k prompt, and the inter-token latency of its decode (128 tokens after the
prompt: decode at that context), next to the issue's vLLM 0.26 figures and the floors.

    python benchmarks/long_context.py --model DIR [--dtype bfloat16] [--lens 1024,16384,32000]

Floors (Llama-3-8B shape, H200; issue #18): TTFT 16k ≈ 350 ms, 32k ≈ 920 ms (linear
FLOPs + causal attention at 805 TFLOP/s); ITL at 32k ≈ 4.5 ms (15 GB of weights + 4.3 GB
of KV at 4.27 TB/s); batch-1 decode at 1k: 285 tok/s.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import replace

from _shared import emit, start_server, stop_server

from expresslane.bench.client import ClientOptions
from expresslane.bench.scenarios import ScenarioConfig, run_scenarios

# issue #18's table: (vLLM 0.26 with FlashAttention 3, floor), through HTTP on the same H200
BARS = {"ttft_16384": (494.0, 350.0), "ttft_32000": (1205.0, 920.0), "itl_32000": (5.97, 4.5),
        "itl_1024": (1000 / 210, 1000 / 285)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-model-len", type=int, default=33792)
    ap.add_argument("--lens", default="1024,16384,32000", help="prompt lengths, each sent alone")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--serve-flags", default="", help="extra `serve` flags, space-separated")
    ap.add_argument("--logs", default=".")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    proc, url = start_server([args.model, "--dtype", args.dtype, "--max-model-len", str(args.max_model_len),
                              *args.serve_flags.split()],
                             os.path.join(args.logs, "serve-long-context" + "".join(args.serve_flags.split()) + ".log"),
                             timeout=600)
    rows = {}
    try:
        base = ScenarioConfig(client=ClientOptions(base_url=url, ignore_eos=True), run=("isolated",),
                              output_len=args.output_len, repeats=args.repeats)
        for n in (int(x) for x in args.lens.split(",")):
            iso = run_scenarios(replace(base, isolated_lens=(n,)))["isolated"]
            ttft = next(iter(iso["ttft_ms"].values()))
            rows[n] = {"ttft_ms": ttft, "itl_ms": iso["batch1_itl_ms"], "failed": iso["failed"]}
            emit(args.out, bench="long_context", prompt_tokens=n, output_tokens=args.output_len,
                 repeats=args.repeats, max_model_len=args.max_model_len, serve_flags=args.serve_flags, **rows[n])
    finally:
        stop_server(proc)
    print(f"\nserve flags: {args.serve_flags or '(none)'}")
    print(f"{'prompt':>8} {'TTFT ms':>9} {'vLLM':>7} {'floor':>7} | {'ITL ms':>7} {'vLLM':>6} {'floor':>6}")
    for n, r in rows.items():
        t_bar, i_bar = BARS.get(f"ttft_{n}", (None, None)), BARS.get(f"itl_{n}", (None, None))
        cell = lambda v, f: f"{v:{f}}" if v is not None else f"{'—':>{f.split('.')[0]}}"  # noqa: E731
        print(f"{n:>8} {cell(r['ttft_ms'], '9.1f')} {cell(t_bar[0], '7.0f')} {cell(t_bar[1], '7.0f')} | "
              f"{cell(r['itl_ms'], '7.2f')} {cell(i_bar[0], '6.2f')} {cell(i_bar[1], '6.2f')}")


if __name__ == "__main__":
    main()
