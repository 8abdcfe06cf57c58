"""Where a decode step's time goes on the GPU: one decode-graph replay alone against the
weight-read floor, kernels by kind, and the idle time between kernels in steady decode.

    python benchmarks/decode_profile.py --model DIR [--batches 1,64] [--out results.jsonl]

For each batch size B (every sequence decoding at ~--context tokens):
- step_ms: wall time per engine step (the pipelined loop, as the benchmarks see it);
- replay_ms: the captured decode graph for B replayed back to back, nothing else;
- per step, from a torch.profiler trace of steady decode: kernel time by kind (matmul,
  attention, norm/rope/act, sampling and copies) and the GPU's idle time, with the
  matmuls' achieved bandwidth on the weights they read.
Then the TTFT path of one prompt per --ttft-lengths (default 128): host time before the first
kernel, GPU span, host time after the last kernel, and the kernels that took the most time.
"""

from __future__ import annotations

import argparse
import random
import time
from collections import defaultdict

import torch
from _shared import busy_us, emit, kernel_intervals, launch_steps
from torch.profiler import ProfilerActivity, profile, record_function

from expresslane.bench.floors import H200_PEAK_BANDWIDTH as PEAK_BW
from expresslane.bench.floors import decode_weight_bytes
from expresslane.bench.inprocess import random_prompts

KINDS = (("experts", ("moe_gemm",)),  # before matmul: the grouped GEMM's name holds "gemm"
         ("routing", ("route_kernel", "align_kernel")),
         ("matmul", ("gemm", "gemv", "nvjet", "cutlass", "sm90", "splitk")),
         ("attention", ("paged_attention", "write_kv", "reduce_splits")),
         ("norm/rope/act", ("rmsnorm", "rope", "silu")))


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, keys in KINDS:
        if any(k in low for k in keys):
            return kind
    return "other (sampling, copies, embedding)"


def decode_profile(llm, batch: int, context: int, out) -> None:
    from expresslane import SamplingParams

    eng, core = llm.engine, llm.engine.core
    vocab = core.hf_config.vocab_size
    sp = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    for i, ids in enumerate(random_prompts(random.Random(batch), vocab, [context] * batch)):
        eng.add_request(f"p{batch}-{i}", {"prompt_token_ids": ids}, sp)
    while core.scheduler.num_waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                            for r in core.scheduler.running.values()):
        eng.step()
    for _ in range(5):
        eng.step()
    torch.cuda.synchronize()
    t0, steps = time.perf_counter(), 40
    launch_steps(eng, steps)
    torch.cuda.synchronize()
    step_ms = (time.perf_counter() - t0) / steps * 1e3

    graphs = eng.runner.decode_graphs  # the runner's own: replayed alone
    size = min(s for s in graphs.sizes if s >= batch)
    pieces = graphs.graphs[size]  # re-running the in-flight step's graph rewrites the same KV slots
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(50):
        for graph in pieces:
            graph.replay()
    end.record()
    torch.cuda.synchronize()
    replay_ms = start.elapsed_time(end) / 50

    n = 10
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        torch.cuda.synchronize()
        w0 = time.perf_counter()
        launch_steps(eng, n)
        torch.cuda.synchronize()
        wall_us = (time.perf_counter() - w0) * 1e6
    ks = kernel_intervals(prof)
    [weight_bytes] = llm.apply_model(lambda model: decode_weight_bytes(model, batch))  # MoE: the routed share
    by_kind = defaultdict(float)
    for s, e, name in ks:
        by_kind[kind_of(name)] += (e - s) / n / 1e3
    span_us = ks[-1][1] - ks[0][0] if ks else 0.0
    row = dict(bench="decode_profile", batch=batch, context=context, step_ms=step_ms, replay_ms=replay_ms,
               floor_ms=weight_bytes / PEAK_BW * 1e3, kernels_per_step=len(ks) / n,
               busy_ms_per_step=busy_us(ks) / n / 1e3, idle_in_span_ms_per_step=(span_us - busy_us(ks)) / n / 1e3,
               profiled_wall_ms_per_step=wall_us / n / 1e3, ms_by_kind={k: round(v, 4) for k, v in by_kind.items()},
               matmul_gb_per_s=weight_bytes / ((by_kind["matmul"] + by_kind["experts"]) / 1e3) / 1e9
               if by_kind["matmul"] else None,
               top_kernels=top_kernels(ks, n))
    emit(out, **row)
    while eng.has_unfinished():
        eng.step()


def ttft_profile(llm, length: int, out) -> None:
    from expresslane import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=1)
    rng = random.Random(length)
    vocab = llm.engine.core.hf_config.vocab_size
    fresh = lambda: {"prompt_token_ids": random_prompts(rng, vocab, [length])[0]}  # noqa: E731 (no cache hit)
    for _ in range(3):
        llm.generate([fresh()], sp, use_tqdm=False)
    prompt = fresh()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        torch.cuda.synchronize()
        with record_function("generate"):
            [o] = llm.generate([prompt], sp, use_tqdm=False)
    ks = [k for k in kernel_intervals(prof) if k[2] != "generate"]
    cpu = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU]
    [gen] = [e.time_range for e in cpu if e.name == "generate"]
    launches = [e.time_range for e in cpu if e.name == "cudaGraphLaunch"]
    ttft_ms = 1e3 * (o.metrics.first_token_time - o.metrics.arrival_time)
    emit(out, bench="ttft_profile", prompt_len=length, ttft_ms=ttft_ms, generate_ms=(gen.end - gen.start) / 1e3,
         host_before_first_kernel_ms=(ks[0][0] - gen.start) / 1e3, gpu_span_ms=(ks[-1][1] - ks[0][0]) / 1e3,
         gpu_busy_ms=busy_us(ks) / 1e3, host_after_last_kernel_ms=(gen.end - ks[-1][1]) / 1e3, kernels=len(ks),
         largest_gaps=largest_gaps(ks, 4), graph_launches=len(launches),
         graph_launch_host_ms=[round((r.end - r.start) / 1e3, 3) for r in launches], top_kernels=top_kernels(ks, 1))


def top_kernels(ks, steps: int, n: int = 12) -> list[tuple[str, float, int]]:
    """The n kernels with the most GPU time: (name, ms per step, launches per step)."""
    by_name = defaultdict(lambda: [0.0, 0])
    for s, e, name in ks:
        by_name[name][0] += (e - s) / steps / 1e3
        by_name[name][1] += 1
    return [(name[:60], round(t, 4), c // steps) for name, (t, c) in
            sorted(by_name.items(), key=lambda kv: -kv[1][0])[:n]]


def largest_gaps(ks, n: int) -> list[tuple[float, str, str]]:
    """The n longest idle stretches between kernels: (ms, kernel before, kernel after)."""
    gaps, end, last = [], ks[0][1], ks[0][2]
    for s, e, name in ks[1:]:
        if s > end:
            gaps.append((round((s - end) / 1e3, 3), last[:40], name[:40]))
        if e > end:
            end, last = e, name
    return sorted(gaps, reverse=True)[:n]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 64])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--load-format", choices=("auto", "dummy"), default="auto",
                    help="dummy: random weights made on the GPU (a config-only model directory)")
    ap.add_argument("--no-ttft", action="store_true", help="decode steps only")
    ap.add_argument("--ttft-lengths", type=lambda s: [int(x) for x in s.split(",")], default=[128],
                    help="prompt lengths whose first token is profiled")
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from expresslane import LLM

    extra = {"max_model_len": args.max_model_len} if args.max_model_len else {}
    llm = LLM(args.model, max_num_seqs=max(args.batches), gpu_memory_utilization=0.85, load_format=args.load_format,
              **extra)
    for b in args.batches:
        decode_profile(llm, b, args.context, args.out)
    if not args.no_ttft:
        for length in args.ttft_lengths:
            ttft_profile(llm, length, args.out)


if __name__ == "__main__":
    main()
