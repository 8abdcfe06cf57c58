"""Issue #20's throughput run (256 prompts of 512 tokens, 256 out each, all at once) in-engine,
step by step: where its time goes (steps with prefill only, mixed, decodes only), each class
against its floor.

    python benchmarks/throughput_steps.py --model DIR --dtype bfloat16 [--flag scheduling_policy=fcfs]

Floor of a step: the longer of its weight read plus its sequences' KV read at the H200's copy
bandwidth, and its linear layers' FLOP (2 x parameters a token) plus its attention's
(4 x heads x head size a query-key pair) at the bf16 matmul peak.
"""

from __future__ import annotations

import argparse
import gc
import random
import time

import numpy as np
from _shared import emit, parse_flag

from expresslane import LLM, SamplingParams
from expresslane.bench.floors import (
    H200_PEAK_BANDWIDTH,
    H200_PEAK_FLOPS,
    decode_weight_bytes,
)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--flag", action="append", type=parse_flag, default=[], metavar="KEY=VALUE")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--out", default=None)
    args = p.parse_args()

    llm = LLM(args.model, dtype=args.dtype, **dict(args.flag))
    engine, core = llm.engine, llm.engine.core
    cfg = core.hf_config
    rng = random.Random(0)
    vocab = min(cfg.vocab_size, 30000)
    prompts = [[rng.randrange(1, vocab) for _ in range(args.input_len)] for _ in range(args.num_prompts + 1)]
    llm.generate([{"prompt_token_ids": prompts[-1]}], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    gc.collect()
    gc.freeze()  # as the server's engine process does after start-up

    [(weights, params)] = llm.apply_model(
        lambda model: (decode_weight_bytes(model), sum(p.numel() for p in model.parameters())))
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    kv_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * engine.runner.kv_dtype.itemsize
    attn_flop = 4 * cfg.num_hidden_layers * cfg.num_attention_heads * head_dim  # a query-key pair

    sp = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    t0 = time.perf_counter()
    for k, ids in enumerate(prompts[:-1]):
        engine.add_request(f"r{k}", {"prompt_token_ids": ids}, sp)
    steps = []  # (class, measured s, predicted s, floor s, tokens, decodes)
    while engine.has_unfinished():
        engine.step()
        if core.held:
            continue
        plan = core._in_flight.plan.seqs if core._in_flight else []
        stats = core.stats()
        if not plan:
            continue
        chunks = [s for s in plan if len(s.token_ids) > 1]
        decodes = len(plan) - len(chunks)
        tokens = sum(len(s.token_ids) for s in plan)
        keys = sum(s.start_pos + len(s.token_ids) for s in plan)
        pairs = sum(len(s.token_ids) * (s.start_pos + (len(s.token_ids) + 1) / 2) for s in chunks)
        floor = max((weights + kv_token * keys) / H200_PEAK_BANDWIDTH,
                    (2 * params * tokens + attn_flop * pairs) / H200_PEAK_FLOPS)
        kind = "decode" if not chunks else ("mixed" if decodes else "prefill")
        steps.append((kind, stats.step_time, stats.predicted_step_time, floor, tokens, decodes))
    elapsed = time.perf_counter() - t0
    # stats.step_time is the step that completed during the call: one behind the plan; sums over a
    # class are what matter, and the classes change only a few times in the run
    classes = {}
    for kind in ("prefill", "mixed", "decode"):
        rows = [s for s in steps if s[0] == kind]
        if rows:
            a = np.array([s[1:] for s in rows], dtype=float)
            classes[kind] = {"steps": len(rows), "seconds": float(a[:, 0].sum()), "predicted_s": float(a[:, 1].sum()),
                             "floor_s": float(a[:, 2].sum()), "tokens_mean": float(a[:, 3].mean()),
                             "decodes_mean": float(a[:, 4].mean())}
    emit(args.out, bench="throughput_steps", flags=dict(args.flag), num_prompts=args.num_prompts,
         seconds=elapsed, out_tok_per_s=args.num_prompts * args.output_len / elapsed, steps=len(steps), classes=classes)
    for kind, c in classes.items():
        share = c["floor_s"] / c["seconds"] if c["seconds"] else float("nan")  # (a class of untimed steps: 0 s)
        print(f"  {kind:8s} {c['steps']:5d} steps {c['seconds']:7.3f} s (predicted {c['predicted_s']:.3f}, floor "
              f"{c['floor_s']:.3f}: {share:.0%}); mean {c['tokens_mean']:.0f} tokens, "
              f"{c['decodes_mean']:.0f} decodes, {1e3 * c['seconds'] / c['steps']:.2f} ms a step")


if __name__ == "__main__":
    main()
