"""Offline generation throughput: expresslane `LLM.generate` vs transformers `generate`.

Same model directory, same prompts (random token ids, equal length so transformers
needs no padding), greedy, EOS ignored, in one process. Prints one JSON line per engine.

    python benchmarks/offline_throughput.py --preset tiny --num-prompts 64 --output-len 64
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch


def expresslane_run(model_dir: Path, prompts: list[list[int]], output_len: int, device: str, dtype: str,
                    extra: dict) -> dict:
    from expresslane import LLM, SamplingParams

    llm = LLM(str(model_dir), device=device, dtype=dtype, **extra)
    sp = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    _sync(device)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    _sync(device)
    elapsed = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"engine": "expresslane", "seconds": elapsed, "output_tokens": n_out, "tokens_per_s": n_out / elapsed,
            "device": str(llm.engine.core.runner.device), "dtype": str(llm.engine.core.runner.dtype)}


def transformers_run(model_dir: Path, prompts: list[list[int]], output_len: int, device: str, dtype: str,
                     batch_size: int) -> dict:
    from transformers import AutoModelForCausalLM

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                       ("cpu" if device == "auto" else device))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype).to(dev).eval()
    kw = dict(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        model.generate(torch.tensor(prompts[:1], device=dev), max_new_tokens=2, do_sample=False, pad_token_id=0)
        _sync(device)
        t0 = time.perf_counter()
        n_out = 0
        for i in range(0, len(prompts), batch_size):
            batch = torch.tensor(prompts[i:i + batch_size], device=dev)
            out = model.generate(batch, attention_mask=torch.ones_like(batch), **kw)
            n_out += (out.shape[1] - batch.shape[1]) * batch.shape[0]
        _sync(device)
    elapsed = time.perf_counter() - t0
    return {"engine": "transformers", "seconds": elapsed, "output_tokens": n_out, "tokens_per_s": n_out / elapsed,
            "device": str(dev), "dtype": dtype, "batch_size": batch_size}


def _sync(device: str) -> None:
    if torch.cuda.is_available() and device != "cpu":
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model directory (default: build --preset into a temp dir)")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--hf-batch-size", type=int, default=64)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    args = ap.parse_args()

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(args.model) if args.model else None
        if model_dir is None:
            from expresslane.models.presets import make_model
            model_dir = make_model(args.preset, Path(tmp) / args.preset,
                                   device="cuda" if torch.cuda.is_available() and args.device != "cpu" else "cpu")
        from transformers import AutoConfig
        vocab = AutoConfig.from_pretrained(model_dir).vocab_size
        rng = random.Random(0)
        prompts = [[rng.randrange(min(vocab, 30000)) for _ in range(args.input_len)] for _ in range(args.num_prompts)]
        extra = {}
        if args.max_num_batched_tokens:
            extra["max_num_batched_tokens"] = args.max_num_batched_tokens
        results = [expresslane_run(model_dir, prompts, args.output_len, args.device, args.dtype, extra)]
        if not args.skip_hf:
            results.append(transformers_run(model_dir, prompts, args.output_len, args.device, args.dtype,
                                            args.hf_batch_size))
    for r in results:
        r.update(model=args.model or args.preset, num_prompts=args.num_prompts, input_len=args.input_len,
                 output_len=args.output_len, threads=torch.get_num_threads())
        print(json.dumps(r))


if __name__ == "__main__":
    main()
