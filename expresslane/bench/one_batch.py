"""One static batch through the in-process engine, timed step by step (``bench one-batch``).

``batch_size`` prompts of ``input_len`` random token ids are queued, then the engine
is stepped by hand under ``batching=static``: step 1 prefills the whole batch and
samples every request's first token, each later step decodes one token for every
request. Each step is timed on the host around ``engine.step()``, after a device
synchronize, so a step's time covers its GPU work (the sampler's ``tolist`` already
waits for it; the explicit sync keeps that true whatever the runner does).

Against the physical limit (``floors.py``): a decode step reads every weight once,
except the embedding table, of which it gathers a few rows (a tied table is read whole
as the output projection), plus each request's KV cache so far. The floor of a step is
the weight bytes at the device's peak bandwidth; the report gives achieved bandwidth
and the floor as a fraction of the measured median step.
"""

from __future__ import annotations

import random
import statistics
import time
from datetime import datetime

import torch

from expresslane import LLM, SamplingParams
from expresslane.bench.floors import H200_PEAK_BANDWIDTH, decode_weight_bytes
from expresslane.bench.inprocess import device_and_dtype, random_prompts, release_memory, synchronize
from expresslane.config.bench import OneBatchConfig

PROMPT_SEED = 0


def time_batch(llm: LLM, prompts: list[list[int]], output_len: int,
               device: torch.device) -> list[float]:
    """Seconds between the batch's successive tokens: [0] is the prefill (until the first
    tokens), then one entry per decode step. The engine launches a step before it hands
    back the previous one's tokens, so steps are timed by when their tokens arrive."""
    engine = llm.engine
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(f"one-batch-{i}", {"prompt_token_ids": ids}, params)
    steps: list[float] = []
    synchronize(device)
    last = time.perf_counter()
    while engine.has_unfinished():
        outs = engine.step()
        if not outs:
            continue
        now = time.perf_counter()
        if not steps and len(outs) != len(prompts):
            raise RuntimeError(f"the first step started {len(outs)} of {len(prompts)} requests: "
                               "the batch does not fit the KV cache or --max-num-seqs; lower "
                               "--batch-size or the lengths")
        steps.append(now - last)
        last = now
    return steps


def run_one_batch(cfg: OneBatchConfig) -> dict:
    cfg.validate()
    b, n_in, n_out = cfg.batch_size, cfg.input_len, cfg.output_len
    # max_num_seqs = the batch: never binding, and the KV cache is sized for this batch only
    quant = {} if cfg.quantization == "none" else {"quantization": cfg.quantization}
    llm = LLM(cfg.model, **{"max_num_seqs": b, **cfg.engine_args, **quant,
                            "batching": "static", "max_batch_size": b})
    device, dtype = device_and_dtype(llm)
    vocab = llm.engine.core.hf_config.vocab_size
    rng = random.Random(PROMPT_SEED)
    # warm-up: the same shapes (one prefill and one decode step), untimed
    llm.generate([{"prompt_token_ids": p} for p in random_prompts(rng, vocab, [n_in] * b)],
                 SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True), use_tqdm=False)
    steps = time_batch(llm, random_prompts(rng, vocab, [n_in] * b), n_out, device)
    prefill, decode = steps[0], steps[1:]
    median_step = statistics.median(decode)

    [weight_bytes] = llm.apply_model(decode_weight_bytes)
    kv_bytes_per_token = llm.engine.runner.kv_block_bytes() // llm.config.cache.block_size
    # decode step k (1-based) attends over the prompt and k tokens, for every request
    kv_read = [b * (n_in + k) * kv_bytes_per_token for k in range(1, len(decode) + 1)]
    achieved = (len(decode) * weight_bytes + sum(kv_read)) / sum(decode)
    on_gpu = device.type == "cuda"
    model_id = str(llm.engine.core.model_dir)
    quantization: dict = {"method": cfg.quantization}
    kv_dtype = cfg.engine_args.get("kv_cache_dtype", "auto")
    if cfg.quantization != "none" or kv_dtype != "auto":
        from expresslane.bench.accuracy import plot_accuracy, quantization_accuracy

        del llm  # the timed engine's memory (its KV cache fills the GPU) goes first
        release_memory()
        args = {k: v for k, v in cfg.engine_args.items() if k in ("dtype", "device", "attention_backend", "seed")}
        quantization["kv_cache_dtype"] = kv_dtype
        quantization["accuracy"] = quantization_accuracy(
            cfg.model, quant.get("quantization"), baseline_model=cfg.baseline_model, trials=cfg.accuracy_trials,
            num_texts=cfg.accuracy_texts, text_len=cfg.accuracy_text_len, kv_cache_dtype=kv_dtype, **args)
        if cfg.accuracy_chart:
            plot_accuracy(quantization["accuracy"], cfg.accuracy_chart)
    peak = cfg.peak_bandwidth or H200_PEAK_BANDWIDTH
    floor_step = weight_bytes / peak if on_gpu else None
    return {
        "kind": "one-batch",
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "model_id": model_id,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if on_gpu else None,
        "dtype": str(dtype).removeprefix("torch."),
        "num_threads": torch.get_num_threads(),
        "batch_size": b,
        "input_len": n_in,
        "output_len": n_out,
        # a quantized run's accuracy against the unquantized model (expresslane.bench.accuracy)
        "quantization": quantization,
        "timing": "host wall time of each engine.step(), device synchronized; step 1 = prefill",
        "prefill_latency_ms": prefill * 1e3,
        "prefill_throughput": b * n_in / prefill,
        "median_decode_step_ms": median_step * 1e3,
        "decode_throughput": b * len(decode) / sum(decode),
        "total_latency_ms": sum(steps) * 1e3,
        "output_throughput": b * n_out / sum(steps),
        "step_latencies_ms": [t * 1e3 for t in steps],
        "weight_bytes": weight_bytes,
        "kv_bytes_per_token": kv_bytes_per_token,
        "mean_kv_bytes_per_step": sum(kv_read) / len(kv_read),
        "achieved_bandwidth": achieved,
        "peak_bandwidth": peak if on_gpu else None,
        "bandwidth_utilization": achieved / peak if on_gpu else None,
        "floor_step_ms": floor_step * 1e3 if on_gpu else None,
        "fraction_of_floor": floor_step / median_step if on_gpu else None,
    }


def format_one_batch(r: dict) -> str:
    def num(x: float | None, spec: str, scale: float = 1.0) -> str:
        return "-" if x is None else format(x / scale, spec)

    rows = [
        ("Model", r["model_id"]),
        ("Device", f"{r['device_name'] or r['device']}, {r['dtype']}"),
        ("Batch x input x output", f"{r['batch_size']} x {r['input_len']} x {r['output_len']}"),
        ("Quantization", r["quantization"]["method"]),
        ("Prefill latency (ms)", num(r["prefill_latency_ms"], ".2f")),
        ("Prefill throughput (tok/s)", num(r["prefill_throughput"], ",.0f")),
        ("Median decode step (ms)", num(r["median_decode_step_ms"], ".2f")),
        ("Decode throughput (tok/s)", num(r["decode_throughput"], ",.0f")),
        ("Total latency (ms)", num(r["total_latency_ms"], ".2f")),
        ("Weights read per decode step (GB)", num(r["weight_bytes"], ".4f", 1e9)),
        ("KV read per decode step, mean (GB)", num(r["mean_kv_bytes_per_step"], ".4f", 1e9)),
        ("Achieved bandwidth (GB/s)", num(r["achieved_bandwidth"], ",.1f", 1e9)),
        ("Peak bandwidth (GB/s)", num(r["peak_bandwidth"], ",.0f", 1e9)),
        ("Bandwidth utilization", num(r["bandwidth_utilization"], ".1%")),
        ("Floor of a decode step (ms)", num(r["floor_step_ms"], ".3f")),
        ("Fraction of floor", num(r["fraction_of_floor"], ".1%")),
    ]
    out = [f"{' One-Batch Benchmark Result ':=^60}"]
    out += [f"{label + ':':<36}{value:>24}" for label, value in rows]
    out.append("=" * 60)
    if "accuracy" in r["quantization"]:
        from expresslane.bench.accuracy import format_accuracy
        out.append(format_accuracy(r["quantization"]["accuracy"]))
    return "\n".join(out)
