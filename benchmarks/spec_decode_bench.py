"""Speculative decoding on held-out code: acceptance rate and decode speed-up against the
same engine without speculation, in one run (issue #11).

    python benchmarks/spec_decode_bench.py [--model DIR --draft DIR] [--batch-sizes 1,64]

Prompts are held-out stdlib files (expresslane/bench/code_corpus.py), never seen in training:
``completion`` continues a file from its first --prompt-tokens tokens; ``edit`` gives a piece of
a file, a marker line, then the piece's first lines again, so the continuation repeats code from
the prompt (what prompt lookup is for). Each method (none, ngram, draft_model) runs every
workload at every batch size: batch 1 sends the requests one after another, batch B sends B at
once. Greedy, ignore_eos. The engines are built side by side and take turns, --rounds times
per workload and batch size (the order rotating): the 9M model's steps are host-bound, and the
same engine measured 1,125 and 1,609 tok/s in two invocations on one H200 host, so only
engines measured at the same time are compared. Reported per row: decode tokens per second
per request (median over requests and rounds of (output tokens - 1) / (finish - first token)),
the speed-up over ``none`` on the same rows, the acceptance rate and mean tokens per verify
step, the verify steps, and whether every output equals ``none``'s (greedy: it must in
float32; in bf16 a verify computes 5 positions where a plain step computes one, and near-ties
may flip).
"""

from __future__ import annotations

import argparse
import statistics
import time

from _shared import emit

from expresslane import LLM, SamplingParams
from expresslane.bench.code_corpus import stdlib_files
from expresslane.models.model_dir import DEFAULT_DRAFT_MODEL, DEFAULT_MODEL


def workloads(tokenizer, n: int, prompt_tokens: int) -> dict[str, list[list[int]]]:
    files = [t for _, t in stdlib_files("held-out")]
    completion, edit = [], []
    i = 0
    while len(completion) < n:
        ids = tokenizer.encode(files[i % len(files)], add_special_tokens=False)
        start = (i // len(files)) * prompt_tokens  # more prompts than files: later pieces of each
        piece = ids[start:start + prompt_tokens] or ids[:prompt_tokens]
        completion.append([tokenizer.bos_token_id, *piece])
        head = tokenizer.decode(piece[:prompt_tokens // 4])
        edit.append(tokenizer.encode(tokenizer.decode(piece) + "\n\n# the same, again:\n" + head))
        i += 1
    return {"completion": completion, "edit": edit}


def run(llm: LLM, prompts: list[list[int]], batch: int, max_tokens: int) -> tuple[list, float]:
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs, t0 = [], time.perf_counter()
    for i in range(0, len(prompts), batch):
        outs += llm.generate([{"prompt_token_ids": p} for p in prompts[i:i + batch]], sp, use_tqdm=False)
    return outs, time.perf_counter() - t0


def decode_rate(out) -> float:
    m = out.metrics
    n = len(out.outputs[0].token_ids)
    return (n - 1) / max(1e-9, m.finished_time - m.first_token_time)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--draft", default=str(DEFAULT_DRAFT_MODEL))
    ap.add_argument("--methods", default="none,ngram,draft_model")
    ap.add_argument("--batch-sizes", default="1,64")
    ap.add_argument("--num-prompts", type=int, default=64, help="per workload and batch size (batch 1: the first 8)")
    ap.add_argument("--prompt-tokens", type=int, default=384)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--speculative-disable-by-batch-size", type=int, default=None,
                    help="default: the step-cost model decides")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    batches = [int(b) for b in args.batch_sizes.split(",")]
    methods = args.methods.split(",")
    # every engine holds its KV cache at once: a fixed number of blocks for the largest batch
    blocks = max(-(-max(batches) * (2 * args.prompt_tokens + args.max_tokens + 64) // 16), 2048 // 16) + 64
    engines = {}
    for method in methods:
        spec = {"none": {}, "ngram": {"speculative_method": "ngram"},
                "draft_model": {"speculative_model": args.draft}}[method]
        if spec:
            spec |= {"num_speculative_tokens": args.num_speculative_tokens,
                     "speculative_disable_by_batch_size": args.speculative_disable_by_batch_size}
        engines[method] = llm = LLM(args.model, dtype=args.dtype, max_model_len=2048, num_kv_blocks=blocks, **spec)
        prompts = workloads(llm.engine.tokenizer, args.num_prompts, args.prompt_tokens)
        run(llm, prompts["completion"][:2], 1, 8)  # warm-up
    for name, all_prompts in prompts.items():
        for batch in batches:
            ps = all_prompts[:8] if batch == 1 else all_prompts[:args.num_prompts]
            rates = {m: [] for m in methods}
            tokens = {m: [] for m in methods}
            counts = dict.fromkeys(methods, (0, 0, 0, 0))  # draft tokens, accepted, verifies, engine steps
            for r in range(args.rounds):
                for method in methods[r % len(methods):] + methods[:r % len(methods)]:
                    core = engines[method].engine.core
                    before, calls = core.stats(), core._calls
                    outs, _ = run(engines[method], ps, batch, args.max_tokens)
                    after = core.stats()
                    rates[method] += [decode_rate(o) for o in outs]
                    tokens[method].append([o.outputs[0].token_ids for o in outs])
                    counts[method] = tuple(a + b for a, b in zip(counts[method], (
                        after.spec_num_draft_tokens - before.spec_num_draft_tokens,
                        after.spec_num_accepted_tokens - before.spec_num_accepted_tokens,
                        after.spec_num_drafts - before.spec_num_drafts, core._calls - calls)))
            for method in methods:
                config = engines[method].config  # device and dtype as resolved
                row = {"bench": "spec_decode", "method": method, "workload": name, "batch": batch,
                       "requests": len(ps), "rounds": args.rounds,
                       "decode_tok_s_per_request": round(statistics.median(rates[method]), 1),
                       "device": config.device.device, "dtype": config.model.dtype}
                drafts, accepted, verifies, steps = counts[method]
                if method != "none":
                    row |= {"acceptance_rate": round(accepted / drafts, 3) if drafts else None,
                            "tokens_per_verify": round(1 + accepted / verifies, 2) if verifies else None,
                            "verifies": verifies, "engine_steps": steps}
                if method != "none" and "none" in methods:
                    row |= {"speedup": round(statistics.median(rates[method]) / statistics.median(rates["none"]), 2),
                            "same_tokens_as_none": tokens[method] == tokens["none"]}
                emit(args.out, **row)
    for method in methods:
        sd = engines[method].engine.core.spec
        if sd is not None and sd.cost_model is not None:  # what the step-cost model weighed
            per_token = {f"batch_{b}": [round(x * 1e3, 3) for x in sd.predicted_costs([args.prompt_tokens] * b)]
                         for b in batches}
            emit(args.out, bench="spec_decision", method=method, cost_model=sd.cost_model.describe(),
                 acceptance=round(sd.acceptance(), 3),
                 verify_scale={f"batch_{b}": round(sd.verify_scale(b), 3) for b in batches},
                 draft_cost_ratio=round(sd.draft_cost_ratio, 4), predicted_ms_per_token_plain_spec=per_token)


if __name__ == "__main__":
    main()
