"""Host time of an engine step by phase, without and with speculation (issue #11): where a
verify step's time goes on a host-bound model.

    python benchmarks/step_phases.py [--model DIR] [--dtype bfloat16] [--methods none,ngram]

Batch 1, the held-out edit-style prompts of spec_decode_bench.py, greedy; speculation forced on
(`speculative_disable_by_batch_size` 256). Each phase is timed around its call (time.perf_counter)
and reported as calls and mean µs: the scheduler's plan and update, the runner's input gather,
its launch (`execute`; for a verify step `_logits_at`, the forward's launch, and `verify`, the
acceptance), the wait for the step's tokens (`StepResult.get`), the output processing, and the
whole `EngineCore.step`. The phases of one step add up to less than the step (its remaining
bookkeeping), and the timers themselves cost ~1 µs a call.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

from _shared import emit
from spec_decode_bench import run, workloads

import expresslane.runner.model_runner as model_runner
from expresslane import LLM
from expresslane.models.model_dir import DEFAULT_MODEL


def timed(times: dict[str, list[float]], key: str, fn):
    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            times[key].append(time.perf_counter() - t)
    return wrapper


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--methods", default="none,ngram")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    for method in args.methods.split(","):
        spec = {} if method == "none" else {"speculative_method": "ngram", "num_speculative_tokens": 4,
                                            "speculative_disable_by_batch_size": 256}
        llm = LLM(args.model, dtype=args.dtype, max_model_len=2048, **spec)
        core, runner = llm.engine.core, llm.engine.runner  # its internals are timed
        prompts = workloads(llm.engine.tokenizer, args.prompts, 384)["edit"]
        run(llm, prompts[:2], 1, 8)  # warm-up
        times: dict[str, list[float]] = defaultdict(list)
        originals = []
        for obj, name, key in ((core, "step", "core_step"), (core.scheduler, "schedule", "schedule"),
                               (core.scheduler, "update", "update"), (runner, "execute", "execute"),
                               (runner.rows, "apply", "rows_apply"), (runner, "_logits_at", "verify_forward"),
                               (llm.engine.outputs, "process", "output_process"),
                               (model_runner, "verify", "verify_accept"), (model_runner.StepResult, "get", "result_get")):
            originals.append((obj, name, getattr(obj, name)))
            setattr(obj, name, timed(times, key, getattr(obj, name)))
        try:
            calls = core._calls
            outs, wall = run(llm, prompts, 1, args.max_tokens)
        finally:
            for obj, name, fn in reversed(originals):
                setattr(obj, name, fn)
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        steps = core._calls - calls
        emit(args.out, bench="step_phases", method=method, dtype=llm.config.model.dtype,
             device=llm.config.device.device, tokens=tokens, steps=steps, us_per_token=round(1e6 * wall / tokens, 1),
             us_per_step=round(1e6 * wall / steps, 1),
             phases={k: {"calls": len(v), "mean_us": round(1e6 * statistics.fmean(v), 1)} for k, v in times.items()})
        del llm


if __name__ == "__main__":
    main()
