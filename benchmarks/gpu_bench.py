"""GPU benchmarks of issue #5, against the H200's floors and transformers in the same run.

    python benchmarks/gpu_bench.py --model DIR [--only engine|hf] [--out results.jsonl]

Prints one JSON line per measurement: batch-1 decode (tokens/s, % of the weight-read
floor), engine TTFT by prompt length, prefill TFLOP/s at ~8k tokens, decode throughput
at batch 64 and 256 with 1k context, GPU busy fraction in steady decode, and the same
for transformers where it applies.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from _shared import busy_us, copy_bandwidth, emit, kernel_intervals, launch_steps, prompts_of

from expresslane.bench.floors import H200_PEAK_BANDWIDTH as PEAK_BW
from expresslane.bench.floors import H200_PEAK_FLOPS as PEAK_FLOPS
from expresslane.bench.floors import decode_weight_bytes
from expresslane.config.engine import DeviceConfig


def forward_flops(cfg, tokens: int) -> float:
    """Matmul FLOPs of one causal prefill of `tokens` tokens (linear layers + attention)."""
    h, layers = cfg.hidden_size, cfg.num_hidden_layers
    heads = cfg.num_attention_heads
    d = getattr(cfg, "head_dim", None) or h // heads
    kv = cfg.num_key_value_heads * d
    ffn = 3 * h * cfg.intermediate_size
    if getattr(cfg, "num_experts_per_tok", None):  # a mixture of experts: the experts a token runs
        ffn = 3 * h * (getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size) * cfg.num_experts_per_tok
    linear = layers * (h * (heads * d + 2 * kv) + heads * d * h + ffn) + h * cfg.vocab_size
    attn = layers * 2 * heads * d * tokens * tokens  # QK^T and PV, causal half of 2*2
    return 2 * linear * tokens + attn


def sync() -> None:
    torch.cuda.synchronize()


def engine_benchmarks(args, out) -> None:
    from expresslane import LLM, SamplingParams

    llm = LLM(args.model, max_num_seqs=256, max_num_batched_tokens=args.max_num_batched_tokens,
              gpu_memory_utilization=0.85, load_format=args.load_format, scheduling_policy=args.scheduling_policy,
              prefill_attention=args.prefill_attention,
              **({"max_model_len": args.max_model_len} if args.max_model_len else {}))
    core = llm.engine.core
    cfg, vocab = core.hf_config, core.hf_config.vocab_size
    [(wbytes, backend)] = llm.apply_model(
        lambda model: (decode_weight_bytes(model), type(model.layers[0].self_attn.backend).__name__))
    floor_ms = wbytes / PEAK_BW * 1e3
    copy_bw = copy_bandwidth()  # this GPU's own floor (an H100's differs from the H200's PEAK_BW)
    common = dict(engine="expresslane", model=args.model.rstrip("/").split("/")[-1], policy=args.scheduling_policy,
                  prefill_attention=args.prefill_attention,
                  backend=backend, cuda_graphs=bool(llm.cuda_graph_sizes["decode"]),
                  **({"label": args.label} if args.label else {}))
    greedy = lambda n: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)  # noqa: E731
    llm.generate([{"prompt_token_ids": p} for p in prompts_of(4, 64, vocab)], greedy(8), use_tqdm=False)  # warm-up

    # batch-1 decode: time per output token after the first
    if "decode" in args.benches:
        [o] = llm.generate([{"prompt_token_ids": prompts_of(1, 128, vocab, 1)[0]}], greedy(257), use_tqdm=False)
        per_tok = (o.metrics.finished_time - o.metrics.first_token_time) / 256
        emit(out, **common, bench="decode_batch1", ms_per_token=per_tok * 1e3, tokens_per_s=1 / per_tok,
             floor_ms=floor_ms, pct_of_floor=100 * floor_ms / (per_tok * 1e3), weight_gb=wbytes / 1e9,
             copy_tb_s=copy_bw / 1e12, pct_of_measured_floor=100 * wbytes / copy_bw / per_tok)

    # TTFT alone, inside the engine (arrival -> first token), median of 3
    for n in args.ttft_lengths if "ttft" in args.benches else ():
        n = min(n, core.max_model_len - 2)
        ttfts = []
        for rep in range(3):
            [o] = llm.generate([{"prompt_token_ids": prompts_of(1, n, vocab, 100 + rep)[0]}], greedy(1),
                               use_tqdm=False)
            ttfts.append(o.metrics.first_token_time - o.metrics.arrival_time)
        ttft = statistics.median(ttfts)
        row = dict(bench="ttft", prompt_len=n, ttft_ms=ttft * 1e3)
        if n >= 4096:
            tf = forward_flops(cfg, n) / ttft / 1e12
            row.update(prefill_tflops=tf, pct_of_peak=100 * tf * 1e12 / PEAK_FLOPS)
        emit(out, **common, **row)

    # steady decode throughput at batch B with ~1k context, and GPU busy fraction. Every request must
    # still be decoding in the timed steps: the prompts take one step budget at a time (a policy that
    # sizes steps by SLOs takes more steps), so each may decode far more than it will, and the ones
    # left are aborted (with 64 new tokens the first had finished: 4.1 ms steps at "batch 64" for the
    # qwen3-30b-a3b shape, where all 64 take 18.4)
    for batch in (64, 256) if "throughput" in args.benches else ():
        eng = llm.engine
        ids = [f"b{batch}-{i}" for i in range(batch)]
        for rid, p in zip(ids, prompts_of(batch, 1024, vocab, 7)):
            eng.add_request(rid, {"prompt_token_ids": p}, greedy(1024))
        while core.scheduler.num_waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                                for r in core.scheduler.running.values()):
            eng.step()
        for _ in range(3):
            eng.step()
        sync()
        steps = 24
        t0 = time.perf_counter()
        seqs = launch_steps(eng, steps)
        sync()
        wall = time.perf_counter() - t0
        # GPU busy = kernel time per step (profiled) / wall per step (the unprofiled run above)
        kernel_s, profiled_wall_s = gpu_kernel_time(eng, 8)
        for rid in ids:
            eng.abort(rid)
        while eng.has_unfinished():
            eng.step()
        [weight_bytes] = llm.apply_model(lambda model: decode_weight_bytes(model, batch))
        step_floor_s = weight_bytes / PEAK_BW  # weights only (not the KV reads)
        emit(out, **common, bench="decode_throughput", batch=batch, context=1024, step_ms=wall / steps * 1e3,
             tokens_per_s=sum(seqs) / wall, fewest_seqs=min(seqs), weight_floor_tokens_per_s=batch / step_floor_s,
             gpu_busy_fraction=kernel_s / (wall / steps),
             gpu_busy_fraction_of_profiled_wall=kernel_s / profiled_wall_s)


def gpu_kernel_time(eng, steps: int) -> tuple[float, float]:
    """(GPU kernel time, wall time) per engine step in seconds, from a profiler trace: kernel
    time is the union of kernel intervals (one stream); the wall time is inflated by the
    profiler's own host work per launch."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        sync()
        t0 = time.perf_counter()
        launch_steps(eng, steps)
        sync()
        wall = time.perf_counter() - t0
    return busy_us(kernel_intervals(prof)) / 1e6 / steps, wall / steps


def hf_benchmarks(args, out) -> None:
    from transformers import AutoModelForCausalLM

    if args.load_format == "dummy":  # no weights on disk: transformers' own random init, on the GPU
        from transformers import AutoConfig

        with torch.device("cuda"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.model), dtype=torch.bfloat16)
        model.eval()
    else:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).cuda().eval()
    vocab = model.config.vocab_size
    common = dict(engine="transformers", model=args.model.rstrip("/").split("/")[-1])
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)

    def gen(batch: list[list[int]], new: int) -> float:
        ids = torch.tensor(batch, device="cuda")
        sync()
        t0 = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new, **kw)
        sync()
        return time.perf_counter() - t0

    with torch.inference_mode():
        gen(prompts_of(1, 64, vocab), 4)
        if "decode" in args.benches:
            p = prompts_of(1, 128, vocab, 1)
            per_tok = (gen(p, 65) - gen(p, 1)) / 64
            emit(out, **common, bench="decode_batch1", ms_per_token=per_tok * 1e3, tokens_per_s=1 / per_tok)
        for n in args.ttft_lengths if "ttft" in args.benches else ():
            n = min(n, model.config.max_position_embeddings - 2)
            emit(out, **common, bench="ttft", prompt_len=n,
                 ttft_ms=statistics.median(gen(prompts_of(1, n, vocab, 100 + r), 1) for r in range(3)) * 1e3)
        if "throughput" in args.benches:
            batch = prompts_of(64, 1024, vocab, 7)
            step = (gen(batch, 17) - gen(batch, 1)) / 16
            emit(out, **common, bench="decode_throughput", batch=64, context=1024, step_ms=step * 1e3,
                 tokens_per_s=64 / step)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", default=None)
    ap.add_argument("--only", choices=("engine", "hf"), help="run one side (each wants the whole GPU)")
    ap.add_argument("--label", default=None, help="a tag on the engine's rows (e.g. baseline: an older tree)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--max-model-len", type=int, default=None, help="the engine's (default: the model's)")
    ap.add_argument("--scheduling-policy", default="deadline", help="the engine's (deadline: its default)")
    ap.add_argument("--prefill-attention", default=DeviceConfig().prefill_attention,
                    help="who runs long prefill attention (the engine's default unless given)")
    ap.add_argument("--ttft-lengths", type=lambda s: [int(x) for x in s.split(",")],
                    default=[16, 128, 512, 2048, 8192])
    ap.add_argument("--benches", type=lambda s: s.split(","), default=["decode", "ttft", "throughput"],
                    help="comma-separated subset of decode,ttft,throughput")
    ap.add_argument("--load-format", choices=("auto", "dummy"), default="auto",
                    help="dummy: random weights made on the GPU (a make-model --no-weights directory); "
                         "transformers then uses its own random init")
    args = ap.parse_args()
    if args.only != "hf":
        engine_benchmarks(args, args.out)
    if args.only != "engine":
        hf_benchmarks(args, args.out)


if __name__ == "__main__":
    main()
