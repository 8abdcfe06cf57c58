"""Offline generation throughput (``bench throughput``, as ``vllm bench throughput``):
expresslane's ``LLM.generate`` against transformers' ``generate`` on the same prompts.

Same model directory, same prompts (random token ids of one length, so transformers
needs no padding), greedy, EOS ignored, in one process; each side is warmed up first
and timed with the device synchronized. Transformers runs the prompts in static
batches of ``hf_batch_size``.
"""

from __future__ import annotations

import random
import time
from datetime import datetime

import torch

from expresslane import LLM, SamplingParams
from expresslane.bench.inprocess import device_and_dtype, random_prompts, release_memory, synchronize
from expresslane.config.bench import ThroughputConfig

PROMPT_SEED = 0


def expresslane_run(cfg: ThroughputConfig) -> tuple[dict, list[list[int]], object]:
    llm = LLM(cfg.model, **cfg.engine_args)
    core = llm.engine.core
    prompts = random_prompts(random.Random(PROMPT_SEED), core.hf_config.vocab_size,
                             [cfg.input_len] * cfg.num_prompts)
    greedy = SamplingParams(temperature=0.0, max_tokens=cfg.output_len, ignore_eos=True)
    warm = random_prompts(random.Random(PROMPT_SEED + 1), core.hf_config.vocab_size, [cfg.input_len])
    llm.generate([{"prompt_token_ids": warm[0]}], SamplingParams(max_tokens=2), use_tqdm=False)
    device, dtype = device_and_dtype(llm)
    synchronize(device)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    synchronize(device)
    elapsed = time.perf_counter() - t0
    n_out = sum(len(c.token_ids) for o in outs for c in o.outputs)
    row = {"engine": "expresslane", "seconds": elapsed, "output_tokens": n_out,
           "tokens_per_s": n_out / elapsed, "requests_per_s": len(prompts) / elapsed}
    facts = {"model_id": str(core.model_dir), "device": str(device), "dtype": dtype}
    del llm
    release_memory()
    return row, prompts, facts


@torch.inference_mode()
def transformers_run(cfg: ThroughputConfig, prompts: list[list[int]], facts: dict) -> dict:
    from transformers import AutoModelForCausalLM

    device = torch.device(facts["device"])
    model = AutoModelForCausalLM.from_pretrained(facts["model_id"], dtype=facts["dtype"]).to(device).eval()
    kw = dict(max_new_tokens=cfg.output_len, min_new_tokens=cfg.output_len, do_sample=False,
              eos_token_id=None, pad_token_id=0)
    model.generate(torch.tensor(prompts[:1], device=device), max_new_tokens=2, do_sample=False,
                   pad_token_id=0)
    synchronize(device)
    t0 = time.perf_counter()
    n_out = 0
    for i in range(0, len(prompts), cfg.hf_batch_size):
        batch = torch.tensor(prompts[i:i + cfg.hf_batch_size], device=device)
        out = model.generate(batch, attention_mask=torch.ones_like(batch), **kw)
        n_out += (out.shape[1] - batch.shape[1]) * batch.shape[0]
    synchronize(device)
    elapsed = time.perf_counter() - t0
    del model
    release_memory()
    return {"engine": "transformers", "seconds": elapsed, "output_tokens": n_out,
            "tokens_per_s": n_out / elapsed, "requests_per_s": len(prompts) / elapsed,
            "batch_size": cfg.hf_batch_size}


def run_throughput(cfg: ThroughputConfig) -> dict:
    cfg.validate()
    row, prompts, facts = expresslane_run(cfg)
    rows = [row]
    if not cfg.no_baseline:
        rows.append(transformers_run(cfg, prompts, facts))
    return {"kind": "throughput", "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
            "model_id": facts["model_id"], "device": facts["device"],
            "dtype": str(facts["dtype"]).removeprefix("torch."), "num_threads": torch.get_num_threads(),
            "num_prompts": cfg.num_prompts, "input_len": cfg.input_len, "output_len": cfg.output_len,
            "engine_args": cfg.engine_args, "rows": rows}


def format_throughput(r: dict) -> str:
    out = [f"{' Offline Throughput ':=^72}",
           f"model {r['model_id']} ({r['device']}, {r['dtype']}, {r['num_threads']} threads); "
           f"{r['num_prompts']} prompts x {r['input_len']} tokens -> {r['output_len']} tokens each",
           f"{'engine':<14}{'seconds':>10}{'output tok/s':>16}{'requests/s':>14}"]
    out += [f"{row['engine']:<14}{row['seconds']:>10.2f}{row['tokens_per_s']:>16.1f}"
            f"{row['requests_per_s']:>14.2f}" for row in r["rows"]]
    out.append("=" * 72)
    return "\n".join(out)
