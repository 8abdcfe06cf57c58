"""Issue #41 on the GPU: decode with LoRA adapters against the base model, same shape, same call.

`--mode base` serves the model without adapters (enable_lora off); `--mode lora` serves it with
rank-R adapters on every projection (random weights, written as PEFT directories). Both run:
- decode_batch1: one request, 128-token prompt, time per output token after the first (lora: one adapter);
- decode_batch64: 64 requests with 512-token prompts decoding together, tokens/s over 24 steps after
  every prompt is in (lora: spread over 8 adapters, 8 requests each);
- cold_load (lora only): 16 streams decode (over 4 resident adapters) while a new request arrives every
  --every steps; it names an adapter already in a slot (warm) or one held only in host memory (cold:
  more adapters than slots, so each arrival loads one; all 16 are read into host memory at start). The
  streams' inter-token p99 / max, cold vs warm.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _shared import emit, prompts_of  # noqa: E402

PROJECTIONS = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}


def write_adapter(model_dir: str, out: Path, rank: int, seed: int) -> Path:
    """A PEFT LoRA directory on every projection of `model_dir`'s layers, random A and B."""
    from safetensors.torch import save_file

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    h, inter, d = cfg["hidden_size"], cfg["intermediate_size"], cfg.get("head_dim") or cfg["hidden_size"] // cfg[
        "num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * d, cfg.get("num_key_value_heads", cfg["num_attention_heads"]) * d
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
              "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}  # (in, out)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for part, names in PROJECTIONS.items():
            for name in names:
                fan_in, fan_out = shapes[name]
                prefix = f"base_model.model.model.layers.{layer}.{part}.{name}"
                tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * fan_in ** -0.5
                tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.01
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in tensors.items()}, str(out / "adapter_model.safetensors"))
    targets = [n for names in PROJECTIONS.values() for n in names]
    (out / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": targets, "bias": "none"}))
    return out


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def greedy(n: int):
    from expresslane import SamplingParams

    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def decode_batch1(llm, vocab: int, lora) -> float:
    [o] = llm.generate([{"prompt_token_ids": prompts_of(1, 128, vocab, 1)[0]}], greedy(257), use_tqdm=False,
                       lora_request=lora)
    return (o.metrics.finished_time - o.metrics.first_token_time) / 256


def fill(eng, jobs: list[tuple[str, list[int], object]], new_tokens: int) -> None:
    """Add the requests and step until every prompt is in."""
    for rid, prompt, lora in jobs:
        eng.add_request(rid, {"prompt_token_ids": prompt}, greedy(new_tokens), lora_request=lora)
    sched = eng.core.scheduler
    while sched.num_waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.running.values()):
        eng.step()


def drain(eng, ids) -> None:
    for rid in ids:
        eng.abort(rid)
    while eng.has_unfinished():
        eng.step()


def decode_batch64(llm, vocab: int, loras: list) -> float:
    eng = llm.engine
    jobs = [(f"t{i}", p, loras[i % len(loras)] if loras else None)
            for i, p in enumerate(prompts_of(64, 512, vocab, 7))]
    fill(eng, jobs, 1024)
    for _ in range(3):
        eng.step()
    sync()
    tokens, t0 = 0, time.perf_counter()
    for _ in range(24):
        tokens += sum(1 for o in eng.step() if o.outputs)
    sync()
    wall = time.perf_counter() - t0
    drain(eng, [j[0] for j in jobs])
    return tokens / wall


def stream_gaps(llm, vocab: int, streams: list, arrivals: list, every: int, steps: int
                ) -> tuple[list[float], list[dict]]:
    """Inter-token gaps (s) of 16 decoding streams while a 32-token request arrives every `every` steps,
    the i-th naming arrivals[i % len]; and each step's wall time with what it held (an arrival added
    before it, slot loads started in it, tokens of arrivals it ran)."""
    eng = llm.engine
    jobs = [(f"s{i}", p, streams[i % len(streams)]) for i, p in enumerate(prompts_of(16, 256, vocab, 11))]
    fill(eng, jobs, 4096)
    last, gaps, added, steps_seen = {}, [], [], []
    lora = llm.engine.runner.lora
    before = time.perf_counter()
    for step in range(steps):
        if step % every == 0:
            rid = f"a{step}"
            eng.add_request(rid, {"prompt_token_ids": prompts_of(1, 32, vocab, 1000 + step)[0]}, greedy(4),
                            lora_request=arrivals[(step // every) % len(arrivals)])
            added.append(rid)
        loads = lora.num_loads
        outs = eng.step()
        now = time.perf_counter()
        steps_seen.append(dict(ms=(now - before) * 1e3, step=step, arrival=step % every == 0,
                               loads=lora.num_loads - loads, arrival_outputs=sum(o.request_id.startswith("a")
                                                                                  for o in outs)))
        before = now
        for o in outs:
            if o.request_id.startswith("s"):
                if o.request_id in last:
                    gaps.append(now - last[o.request_id])
                last[o.request_id] = now
    drain(eng, [j[0] for j in jobs] + added)
    return gaps, steps_seen


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--mode", choices=("base", "lora"), required=True)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--adapters", default="/tmp/lora-adapters", help="where the adapters are written")
    ap.add_argument("--every", type=int, default=10, help="cold_load: steps between arrivals")
    ap.add_argument("--steps", type=int, default=300, help="cold_load: steps timed per case")
    ap.add_argument("--no-cold", action="store_true", help="leave out the cold-load streams")
    ap.add_argument("--label", default="", help="names the tree measured (a baseline checkout beside this one)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from expresslane import LLM, LoRARequest

    common = dict(max_num_seqs=256, max_num_batched_tokens=8192, gpu_memory_utilization=0.85)
    loras = []
    if args.mode == "lora":
        dirs = [write_adapter(args.model, Path(args.adapters) / f"r{args.rank}-{i}", args.rank, i) for i in range(16)]
        loras = [LoRARequest(f"a{i}", i + 1, str(d)) for i, d in enumerate(dirs)]
        common.update(enable_lora=True, max_loras=8, max_lora_rank=args.rank, max_cpu_loras=16)
    llm = LLM(args.model, **common)
    for lora in loras:  # every adapter read into host memory: a cold arrival loads a slot from there
        llm.engine.add_lora(lora)
    vocab = llm.engine.core.hf_config.vocab_size
    mode = args.mode + (f"/{args.label}" if args.label else "")
    row = dict(model=Path(args.model).name, mode=mode, rank=args.rank if loras else 0,
               gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
    llm.generate([{"prompt_token_ids": p} for p in prompts_of(4, 64, vocab)], greedy(8), use_tqdm=False,
                 lora_request=loras[:4] or None)  # warm-up (and the first adapters into slots)

    per_tok = decode_batch1(llm, vocab, loras[0] if loras else None)
    emit(args.out, **row, bench="decode_batch1", tokens_per_s=1 / per_tok, ms_per_token=per_tok * 1e3)
    if loras:  # the base model's requests in the same engine (adapters on, none named)
        per_tok = decode_batch1(llm, vocab, None)
        emit(args.out, **row, bench="decode_batch1_no_adapter", tokens_per_s=1 / per_tok, ms_per_token=per_tok * 1e3)
    emit(args.out, **row, bench="decode_batch64", tokens_per_s=decode_batch64(llm, vocab, loras[:8]),
         adapters=min(len(loras), 8))

    if loras and not args.no_cold:
        streams = loras[:4]
        for case, arrivals in (("warm", loras[4:8]), ("cold", loras[8:16])):
            # warm: 4 + 4 adapters fit the 8 slots; cold: 8 more rotate through the 4 slots the streams leave
            loads = llm.engine.runner.lora.num_loads
            gaps, steps = stream_gaps(llm, vocab, streams, arrivals, args.every, args.steps)
            gaps = np.array(gaps) * 1e3
            step_ms = np.array([s["ms"] for s in steps])
            emit(args.out, **row, bench="cold_load", case=case, every=args.every, gaps=len(gaps),
                 itl_p50_ms=float(np.percentile(gaps, 50)), itl_p99_ms=float(np.percentile(gaps, 99)),
                 itl_max_ms=float(gaps.max()), slot_loads=llm.engine.runner.lora.num_loads - loads,
                 step_p50_ms=float(np.percentile(step_ms, 50)), step_p99_ms=float(np.percentile(step_ms, 99)),
                 worst_steps=sorted(steps, key=lambda s: -s["ms"])[:6])
    llm.shutdown()


if __name__ == "__main__":
    main()
