"""Issue #6's acceptance scenario, in-process: short interactive requests arrive while a
long prompt and a crowd of batch-lane requests are running.

    python benchmarks/lanes_scenario.py --model DIR [--long-len 8000 --num-batch 32 --num-short 16]

For each mode (static, continuous, continuous-lanes: the bench package's modes) a fresh engine:
- alone: the short requests (one burst) on the idle engine, and the long prompt alone;
- background: the batch crowd starts and is stepped until every member decodes, then
  the long prompt arrives; its TTFT here is the baseline of its growth;
- mixed: the same, and `--warm-steps` steps after the long prompt the short requests
  arrive as one burst.
Reports P50/P99 TTFT of the short requests (mixed vs alone), the long request's TTFT
growth (mixed vs background: what the short arrivals cost it; and vs alone), and the
targets of #6 (short P99 <= 2x alone and <= 50 ms on GPU; long TTFT growth <= 1.5x).
"""

from __future__ import annotations

import argparse
import random

from _shared import emit

from expresslane.bench.inprocess import MODES, random_prompts, release_memory
from expresslane.bench.stats import distribution

SCENARIO_MODES = ("static", "continuous", "continuous-lanes")


def run_mode(args, mode: str) -> dict:
    from expresslane import LLM, SamplingParams

    n_all = args.num_batch + args.num_short + 1
    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=max(n_all, 8), max_batch_size=n_all,
              max_num_batched_tokens=args.max_num_batched_tokens, **MODES[mode])
    eng = llm.engine
    vocab = llm.engine.core.hf_config.vocab_size
    rng = random.Random(0)
    ids = lambda n: {"prompt_token_ids": random_prompts(rng, vocab, [n])[0]}  # noqa: E731
    short_sp = SamplingParams(temperature=0, max_tokens=args.short_out, ignore_eos=True)
    long_sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    batch_sp = SamplingParams(temperature=0, max_tokens=args.batch_out, ignore_eos=True)

    def ttft(o) -> float:
        return o.metrics.first_token_time - o.metrics.arrival_time

    def run_until(done: dict, finished) -> None:
        """Step until `finished()`; done: request id -> its latest output (first token on)."""
        while not finished():
            done.update((o.request_id, o) for o in eng.step())

    def background(tag: str, with_shorts: bool) -> dict:
        """The crowd decoding, then the long prompt; the short burst `--warm-steps` later."""
        done: dict = {}
        crowd = [f"{tag}-batch{i}" for i in range(args.num_batch)]
        for rid in crowd:
            eng.add_request(rid, ids(args.batch_len), batch_sp, lane="batch")
        run_until(done, lambda: all(rid in done for rid in crowd))
        eng.add_request(f"{tag}-long", ids(args.long_len), long_sp, lane=args.long_lane)
        for _ in range(args.warm_steps):
            done.update((o.request_id, o) for o in eng.step())
        if with_shorts:
            for i in range(args.num_short):
                eng.add_request(f"{tag}-short{i}", ids(args.short_len), short_sp, lane="interactive")
        run_until(done, lambda: not eng.has_unfinished())
        return done

    llm.generate([ids(args.short_len), ids(256)], short_sp, use_tqdm=False)  # warm-up
    alone_short = [ttft(o) for o in llm.generate([ids(args.short_len) for _ in range(args.num_short)], short_sp,
                                                  lane="interactive", use_tqdm=False)]
    [long_alone] = llm.generate([ids(args.long_len)], long_sp, lane=args.long_lane, use_tqdm=False)
    base = background("base", with_shorts=False)
    done = background("mix", with_shorts=True)
    mixed_short = [ttft(done[f"mix-short{i}"]) for i in range(args.num_short)]
    alone_ms, mixed_ms = distribution(alone_short), distribution(mixed_short)
    row = {
        "mode": mode, "short_alone_p50_ms": alone_ms["p50"], "short_alone_p99_ms": alone_ms["p99"],
        "short_mixed_p50_ms": mixed_ms["p50"], "short_mixed_p99_ms": mixed_ms["p99"],
        "long_alone_ms": 1e3 * ttft(long_alone),
        "long_background_ms": 1e3 * ttft(base["base-long"]), "long_mixed_ms": 1e3 * ttft(done["mix-long"]),
        "preemptions": eng.core.scheduler.num_preemptions,
    }
    row["short_p99_ratio"] = row["short_mixed_p99_ms"] / row["short_alone_p99_ms"]
    row["long_growth"] = row["long_mixed_ms"] / row["long_background_ms"]
    row["long_vs_alone"] = row["long_mixed_ms"] / row["long_alone_ms"]
    return row


def run_fresh(args, mode: str) -> dict:
    row = run_mode(args, mode)
    release_memory()  # the mode's engine is gone with run_mode's frame: free its memory for the next
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model directory (default: the built-in tiny model)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--long-len", type=int, default=8000)
    ap.add_argument("--long-lane", default="interactive", choices=("interactive", "batch"),
                    help="the long prompt's lane (the issue names only the crowd as batch work)")
    ap.add_argument("--num-batch", type=int, default=32)
    ap.add_argument("--batch-len", type=int, default=512)
    ap.add_argument("--batch-out", type=int, default=256)
    ap.add_argument("--num-short", type=int, default=16)
    ap.add_argument("--short-len", type=int, default=64)
    ap.add_argument("--short-out", type=int, default=4)
    ap.add_argument("--warm-steps", type=int, default=2, help="steps of the long prompt before the shorts arrive")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--modes", default=",".join(SCENARIO_MODES), help=f"any of {', '.join(MODES)}")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = [run_fresh(args, m) for m in args.modes.split(",")]
    model = (args.model or "tiny").rstrip("/").split("/")[-1]
    for r in rows:
        emit(args.out, bench="lanes_scenario", model=model, long_lane=args.long_lane, **r)
    print(f"{'mode':<18}{'short alone p99':>16}{'short mixed p99':>16}{'ratio':>7}{'long alone':>11}"
          f"{'long bg':>11}{'long mixed':>11}{'growth':>7}")
    for r in rows:
        print(f"{r['mode']:<18}{r['short_alone_p99_ms']:>14.1f}ms{r['short_mixed_p99_ms']:>14.1f}ms"
              f"{r['short_p99_ratio']:>7.2f}{r['long_alone_ms']:>9.1f}ms{r['long_background_ms']:>9.1f}ms"
              f"{r['long_mixed_ms']:>9.1f}ms{r['long_growth']:>7.2f}")


if __name__ == "__main__":
    main()
