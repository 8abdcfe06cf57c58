"""Where a short request's time goes: Python profile of one TTFT, and kernel-launch costs.

    python benchmarks/step_profile.py --model DIR
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import time

import torch
from _shared import emit

from expresslane.bench.inprocess import random_prompts


def per_call_us(fn, n: int = 300) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from expresslane import LLM, SamplingParams
    from expresslane.layers import triton_ops

    x = torch.randn(16, 896, device="cuda", dtype=torch.bfloat16)
    w = torch.ones(896, device="cuda", dtype=torch.bfloat16)
    row = dict(bench="launch_overhead_us",
               triton_rms_norm=per_call_us(lambda: triton_ops.rms_norm(x, w, 1e-6)),
               torch_add=per_call_us(lambda: x + x),
               torch_rms_norm_eager=per_call_us(lambda: x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype) * w))
    emit(args.out, **row)

    llm = LLM(args.model, max_num_seqs=64, gpu_memory_utilization=0.5)
    sp = SamplingParams(temperature=0, max_tokens=1)
    rng = random.Random(128)
    vocab = llm.engine.core.hf_config.vocab_size
    fresh = lambda i: {"prompt_token_ids": random_prompts(rng, vocab, [128])[0]}  # noqa: E731 (no cache hit)
    for i in range(3):
        llm.generate([fresh(i)], sp, use_tqdm=False)
    prof = cProfile.Profile()
    prof.enable()
    [o] = llm.generate([fresh(3)], sp, use_tqdm=False)
    prof.disable()
    print("ttft_ms", 1e3 * (o.metrics.first_token_time - o.metrics.arrival_time))
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
