"""Prompts of lengths the engine has not met, one after another, each timed alone (no median):
what a long-running server pays the first time it meets a length (cuDNN builds an execution
plan per new shape: docs/architecture.md, "Library prefill") and what it pays after.

    python benchmarks/new_lengths.py --model DIR [--prefill-attention auto] [--max-num-batched-tokens 2048]

Prints one JSON line per prompt (its length, its place in the order, TTFT inside the engine).
"""

from __future__ import annotations

import argparse

from _shared import emit, prompts_of

from expresslane import LLM, SamplingParams

LENGTHS = "16384,16000,16100,32000,31000,30500,16200,32000,16384,12345,5000,9000"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", default=None)
    ap.add_argument("--lens", default=LENGTHS, help="prompt lengths, in order (repeats are meant)")
    ap.add_argument("--max-model-len", type=int, default=33792)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--scheduling-policy", default="fcfs")
    ap.add_argument("--prefill-attention", default="auto")
    ap.add_argument("--load-format", choices=("auto", "dummy"), default="auto")
    args = ap.parse_args()
    llm = LLM(args.model, max_num_batched_tokens=args.max_num_batched_tokens, gpu_memory_utilization=0.85,
              load_format=args.load_format, scheduling_policy=args.scheduling_policy,
              prefill_attention=args.prefill_attention, max_model_len=args.max_model_len)
    vocab = llm.engine.core.hf_config.vocab_size
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts_of(4, 64, vocab)], one, use_tqdm=False)  # warm-up
    for i, n in enumerate(int(x) for x in args.lens.split(",")):
        [o] = llm.generate([{"prompt_token_ids": prompts_of(1, n, vocab, 500 + i)[0]}], one, use_tqdm=False)
        emit(args.out, bench="new_lengths", order=i, prompt_len=n, prefill_attention=args.prefill_attention,
             max_num_batched_tokens=args.max_num_batched_tokens, policy=args.scheduling_policy,
             ttft_ms=round((o.metrics.first_token_time - o.metrics.arrival_time) * 1e3, 1))


if __name__ == "__main__":
    main()
