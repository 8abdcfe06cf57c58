"""Issue #16 on one GPU: FP8 weights, INT4 (AWQ) weights and an FP8 KV cache against bf16,
in one run, with the floors and the accuracy each costs.

    python benchmarks/quant_bench.py --model BF16_DIR --awq AWQ_DIR [--out results.jsonl]

Engines, one at a time (each gets the whole GPU): bf16; fp8 (W8A8, quantized at load from
the same bf16 checkpoint, as vLLM's --quantization fp8); the AWQ checkpoint (make-model
--quantization awq: the same weights, 4-bit); bf16 weights with --kv-cache-dtype fp8.
Per engine, as it applies: batch-1 decode (tok/s and % of the weight-read floor), TTFT of a
128-token prompt (median of 5), an 8k prefill (TFLOP/s against the measured FP8 and the bf16
peak), offline throughput of 256 x 512/256, decode at batch 64 with 8k contexts, KV capacity
at start-up, and teacher-forced accuracy against bf16 on texts the bf16 model wrote (top-1
agreement, mean KL, perplexity difference; standard errors over texts). Then the GPU's greedy
tokens against the CPU reference path on short prompts, float32, per format, on a small
peaky random model (tests/models.py), where greedy decoding is well defined.
"""

from __future__ import annotations

import argparse
import gc
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from _shared import emit, prompts_of

from expresslane.bench.floors import H200_PEAK_BANDWIDTH as PEAK_BW
from expresslane.bench.floors import H200_PEAK_FLOPS as PEAK_FLOPS
from expresslane.bench.floors import decode_weight_bytes

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # models.py, quant_models.py


ENGINES = ("bf16", "fp8", "awq", "bf16-weights-fp8-kv")
MEASURES = ("decode", "ttft", "throughput", "long", "accuracy")


def forward_flops(cfg, tokens: int) -> float:
    """Matmul FLOPs of one causal prefill (linear layers + attention), as gpu_bench counts them."""
    h, layers, heads = cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads
    d = getattr(cfg, "head_dim", None) or h // heads
    kv = cfg.num_key_value_heads * d
    linear = layers * (h * (heads * d + 2 * kv) + heads * d * h + 3 * h * cfg.intermediate_size) + h * cfg.vocab_size
    return 2 * linear * tokens + layers * 2 * heads * d * tokens * tokens


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def greedy(n: int):
    from expresslane import SamplingParams
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def measure_fp8_peak(out) -> float:
    """TFLOP/s of torch._scaled_mm (row-wise scales, bf16 out) on 8192^3: the FP8 peak here."""
    n = 8192
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()
    sa, sb = torch.ones(n, 1, device="cuda"), torch.ones(1, n, device="cuda")
    for _ in range(3):
        torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
    torch.cuda.synchronize()
    reps, t0 = 20, time.perf_counter()
    for _ in range(reps):
        torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
    torch.cuda.synchronize()
    tflops = 2 * n**3 * reps / (time.perf_counter() - t0) / 1e12
    emit(out, bench="quant_fp8_peak", tflops=tflops, bf16_peak_tflops=PEAK_FLOPS / 1e12)
    return tflops


def run_engine(args, name: str, out, fp8_peak: float, texts, ref_logits, **engine_kwargs):
    """Every measurement that applies to one engine configuration; returns (texts, its logits on
    them): the first engine (bf16, no `texts`) writes the texts itself."""
    from expresslane import LLM

    t0 = time.perf_counter()
    llm = LLM(engine_kwargs.pop("model"), max_num_seqs=256, max_num_batched_tokens=8192,
              gpu_memory_utilization=0.88, **engine_kwargs)
    load_s = time.perf_counter() - t0
    core = llm.engine.core
    cfg, vocab = core.hf_config, core.hf_config.vocab_size
    [wbytes] = llm.apply_model(decode_weight_bytes)
    common = dict(engine=name, model=Path(args.model).name)
    kv_tokens = core.config.cache.num_kv_blocks * core.config.cache.block_size
    emit(out, **common, bench="quant_engine", load_s=load_s, weight_gb=wbytes / 1e9, kv_tokens=kv_tokens,
         kv_dtype=str(llm.engine.runner.kv_dtype).removeprefix("torch."),
         cuda_graphs=bool(llm.cuda_graph_sizes["decode"]))
    llm.generate([{"prompt_token_ids": p} for p in prompts_of(4, 64, vocab, 0)], greedy(8), use_tqdm=False)

    want = args.measures
    if name != "bf16-weights-fp8-kv" and "decode" in want:
        [o] = llm.generate([{"prompt_token_ids": prompts_of(1, 128, vocab, 1)[0]}], greedy(257), use_tqdm=False)
        per_tok = (o.metrics.finished_time - o.metrics.first_token_time) / 256
        floor_ms = wbytes / PEAK_BW * 1e3
        emit(out, **common, bench="quant_decode_batch1", tokens_per_s=1 / per_tok, ms_per_token=per_tok * 1e3,
             floor_ms=floor_ms, floor_tokens_per_s=1e3 / floor_ms, pct_of_floor=100 * floor_ms / (per_tok * 1e3))
    if name != "bf16-weights-fp8-kv" and "ttft" in want:
        for n, reps in ((128, 5), (min(args.long_prompt, core.max_model_len - 2), 2)):
            ttfts = []
            for rep in range(reps):
                [o] = llm.generate([{"prompt_token_ids": prompts_of(1, n, vocab, 100 + rep)[0]}], greedy(1),
                                   use_tqdm=False)
                ttfts.append(o.metrics.first_token_time - o.metrics.arrival_time)
            ttft = statistics.median(ttfts)
            tflops = forward_flops(cfg, n) / ttft / 1e12
            emit(out, **common, bench="quant_ttft", prompt_len=n, ttft_ms=ttft * 1e3, prefill_tflops=tflops,
                 pct_of_fp8_peak=100 * tflops / fp8_peak, pct_of_bf16_peak=100 * tflops * 1e12 / PEAK_FLOPS)

    if name in ("bf16", "fp8") and "throughput" in want:
        ps = prompts_of(args.tput_prompts, args.tput_input, vocab, 7)
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in ps], greedy(args.tput_output), use_tqdm=False)
        wall = time.perf_counter() - t0
        emit(out, **common, bench="quant_throughput", prompts=len(ps), input_len=args.tput_input,
             output_len=args.tput_output, output_tokens_per_s=len(ps) * args.tput_output / wall, wall_s=wall)

    if name in ("bf16", "bf16-weights-fp8-kv") and "long" in want and args.long_batch:
        # prompts fill the batch one step budget at a time (~64 steps for 64 x 8k); each must still be
        # decoding for the 3 + 16 steps after the last (with 40 new tokens the first had finished:
        # 30 seqs a step on average, not 64)
        eng, batch, out_len = llm.engine, args.long_batch, 128
        ctx = min(args.long_context, core.max_model_len) - out_len
        for i, p in enumerate(prompts_of(batch, ctx, vocab, 11)):
            eng.add_request(f"long-{i}", {"prompt_token_ids": p}, greedy(out_len))
        while core.scheduler.num_waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                                for r in core.scheduler.running.values()):
            eng.step()
        for _ in range(3):
            eng.step()
        sync()
        steps, seqs, t0 = 16, [], time.perf_counter()
        for _ in range(steps):
            eng.step()
            seqs.append(core.stats().batch_size)
        sync()
        wall = time.perf_counter() - t0
        while eng.has_unfinished():
            eng.step()
        emit(out, **common, bench="quant_long_decode", batch=batch, context=ctx, step_ms=wall / steps * 1e3,
             tokens_per_s=sum(seqs) / wall, seqs_per_step=statistics.fmean(seqs), fewest_seqs=min(seqs))

    # accuracy last: sequence_logits overwrites KV blocks 0.. (this engine is done with them)
    logits = None
    if "accuracy" in want:
        texts, logits = accuracy(llm, common, out, args, texts, ref_logits)
    del llm, core
    gc.collect()
    torch.cuda.empty_cache()
    return texts, logits


def accuracy(llm, common: dict, out, args, texts, ref_logits):
    """Teacher-forced logits on `texts` (written by this engine when None, temperature 1 from random
    16-token prompts) and, against `ref_logits`, top-1 agreement, KL and perplexity difference."""
    from expresslane import SamplingParams
    from expresslane.bench.accuracy import compare, sequence_logits

    vocab = llm.engine.core.hf_config.vocab_size
    if texts is None:
        ps = prompts_of(args.texts, 16, vocab, 5)
        outs = llm.generate([{"prompt_token_ids": p} for p in ps],
                            [SamplingParams(temperature=1.0, max_tokens=args.text_len - 16, ignore_eos=True, seed=i)
                             for i in range(len(ps))], use_tqdm=False)
        texts = [p + list(o.outputs[0].token_ids) for p, o in zip(ps, outs)]
    logits = [sequence_logits(llm, t).cpu() for t in texts]  # (1 GB for 8 x 256 x 128k)
    if ref_logits is not None:
        dev = llm.config.device.device
        rows = [compare(r.to(dev), q.to(dev), t) for r, q, t in zip(ref_logits, logits, texts)]

        def mean_se(key):
            vals = [r[key] for r in rows]
            return statistics.fmean(vals), statistics.stdev(vals) / math.sqrt(len(vals))
        agree, kl = mean_se("top1_agreement"), mean_se("kl_divergence")
        ppl_b = math.exp(statistics.fmean(r["nll_base"] for r in rows))
        ppl_q = math.exp(statistics.fmean(r["nll_quant"] for r in rows))
        emit(out, **common, bench="quant_accuracy", texts=len(rows), tokens_per_text=len(texts[0]),
             top1_agreement=agree[0], top1_agreement_se=agree[1], kl=kl[0], kl_se=kl[1],
             perplexity_bf16=ppl_b, perplexity=ppl_q, perplexity_diff=ppl_q - ppl_b)
    return texts, logits


def greedy_vs_cpu(out) -> None:
    """Short prompts, greedy, float32: GPU (Triton kernels, CUDA graphs) == CPU (reference path)."""
    from expresslane import LLM
    from models import build_model
    from quant_models import quantize_dir

    prompts = [[(7 * i + 3 * j) % 500 for j in range(n)] for i, n in enumerate((1, 5, 17, 40, 90, 150))]
    with tempfile.TemporaryDirectory() as tmp:
        base = build_model("llama", Path(tmp) / "llama")
        cases = {"fp8": (quantize_dir(base, Path(tmp) / "fp8", "fp8"), {}),
                 "awq": (quantize_dir(base, Path(tmp) / "awq", "awq"), {}),
                 "gptq": (quantize_dir(base, Path(tmp) / "gptq", "gptq", desc_act=True), {}),
                 "fp8-kv": (base, {"kv_cache_dtype": "fp8"})}
        for name, (path, kw) in cases.items():
            got = {}
            for device, dtype in (("cpu", "float32"), ("cuda", "float32"), ("cuda", "bfloat16")):
                # eager: the kernels are the subject (graphs replay the same kernels) and start-up is faster
                llm = LLM(str(path), device=device, dtype=dtype, num_kv_blocks=256, max_model_len=512, max_num_seqs=8,
                          max_num_batched_tokens=256, enforce_eager=True, **kw)
                outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(8), use_tqdm=False)
                got[device, dtype] = [o.outputs[0].token_ids for o in outs]
            ref = got["cpu", "float32"]
            same = lambda k: sum(a == b for a, b in zip(got[k], ref))  # noqa: E731
            emit(out, bench="quant_greedy_vs_cpu", engine=name, prompts=len(prompts),
                 float32_identical=same(("cuda", "float32")), bfloat16_identical=same(("cuda", "bfloat16")))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="bf16 checkpoint (make-model llama-3-8b)")
    ap.add_argument("--awq", help="AWQ checkpoint of the same weights (make-model ... --quantization awq)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--long-prompt", type=int, default=8192, help="the long TTFT / prefill TFLOP/s prompt")
    ap.add_argument("--tput-prompts", type=int, default=256)
    ap.add_argument("--tput-input", type=int, default=512)
    ap.add_argument("--tput-output", type=int, default=256)
    ap.add_argument("--long-batch", type=int, default=64, help="long-context decode batch (0: skip)")
    ap.add_argument("--long-context", type=int, default=8192)
    ap.add_argument("--texts", type=int, default=8, help="accuracy texts")
    ap.add_argument("--text-len", type=int, default=256)
    ap.add_argument("--engines", default=",".join(ENGINES), help="a subset of " + ", ".join(ENGINES))
    ap.add_argument("--measures", default=",".join(MEASURES), help="a subset of " + ", ".join(MEASURES))
    ap.add_argument("--no-greedy-check", action="store_true", help="skip the GPU-vs-CPU greedy tokens")
    args = ap.parse_args()
    args.measures = set(args.measures.split(","))
    engines = args.engines.split(",")
    if unknown := set(engines) - set(ENGINES) | args.measures - set(MEASURES):
        ap.error(f"unknown engines or measures: {', '.join(sorted(unknown))}")

    out = args.out
    if not args.no_greedy_check:
        greedy_vs_cpu(out)
    fp8_peak = measure_fp8_peak(out)
    kwargs = {"bf16": dict(model=args.model), "fp8": dict(model=args.model, quantization="fp8"),
              "awq": dict(model=args.awq), "bf16-weights-fp8-kv": dict(model=args.model, kv_cache_dtype="fp8")}
    texts = ref = None
    for name in engines:  # bf16 first: the others' accuracy is against its texts and logits
        if name == "awq" and not args.awq:
            continue
        texts, logits = run_engine(args, name, out, fp8_peak, texts, ref, **kwargs[name])
        ref = logits if name == "bf16" else ref


if __name__ == "__main__":
    main()
