"""Does the step-cost model the engine calibrates at start-up predict the steps a mixed load
really runs (the load of `gpu.sh flat`, docs/performance.md "Flat latency through HTTP")?

    python benchmarks/step_cost_check.py [--model DIR] [--dtype bfloat16] [--out results.jsonl]

Times, as the start-up calibration does (`runner.step_timing.time_steps`: alone, fastest of
--repeats after one untimed run), the shapes of that load's steps: 1, 3 or 5 decodes at a
short (128) or long (--long) context, beside one prefill chunk of 16-512 tokens after 0 to
--long cached keys; and prints each against the start-up model's prediction. Where these
isolated steps match the model but a served load's steps cost more (a server's refits at run
time), the difference comes from running steps back to back (the host, the pipeline); where
they do not, from a shape the calibration never times.
"""

from __future__ import annotations

import argparse
import statistics

from _shared import emit

from expresslane import LLM
from expresslane.models.model_dir import DEFAULT_MODEL
from expresslane.runner.step_timing import time_steps


def shapes(long: int, max_len: int) -> list[list[tuple[int, int]]]:
    """Decodes (context, 1) beside a chunk (start, n): the mixed load's steps, within the context."""
    out = []
    for decodes in (1, 3, 5):
        for context in (128, long):
            for start in sorted({0, long // 4, long // 2, max(0, long - 512)}):
                for n in (16, 64, 136, 200, 512):
                    if max(context, start + n) < max_len:
                        out.append([(context, 1)] * decodes + [(start, n)])
    return out


def throughput_shapes(context: int, budget: int) -> list[list[tuple[int, int]]]:
    """The throughput run's steps (256 prompts of 512 at once): d decodes at `context` keys beside
    the rest of a `budget`-token step as 512-token prompts, and decodes alone."""
    out = []
    for decodes in (0, 32, 64, 128, 192):
        rest = budget - decodes
        out.append([(context, 1)] * decodes + [(0, min(512, rest - k)) for k in range(0, rest, 512)])
    out += [[(context, 1)] * d for d in (64, 128, 192, 256)]
    return out


def profile(runner, step: list[tuple[int, int]], top: int = 12) -> None:
    """GPU time by kernel name over one run of `step` (after the timed runs: compiled, warm)."""
    import torch
    from _shared import kernel_intervals

    from expresslane.runner.step_timing import _run

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        _run(runner, step, runner.block_size)
    by_name: dict[str, float] = {}
    spans = kernel_intervals(prof)
    for s0, e0, name in spans:
        by_name[name[:90]] = by_name.get(name[:90], 0.0) + (e0 - s0)
    total = sum(by_name.values())
    print(f"  kernels of {len(step) - sum(n > 1 for _, n in step)} decodes + {sum(n for _, n in step if n > 1)} "
          f"prefill tokens: {total / 1e3:.2f} ms of GPU time, {(spans[-1][1] - spans[0][0]) / 1e3:.2f} ms first to last")
    for name, us in sorted(by_name.items(), key=lambda kv: -kv[1])[:top]:
        print(f"    {us / 1e3:7.3f} ms  {name}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(DEFAULT_MODEL))
    p.add_argument("--dtype", default="auto")
    p.add_argument("--long", type=int, default=8192, help="the long context (cut to the model's)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--shapes", choices=("mixed", "throughput", "prompts"), default="mixed",
                   help="mixed: the mixed load's (default); throughput: the throughput run's (decodes at 640 keys "
                        "beside 512-token prompts filling the step budget, and decodes alone); prompts: one prompt "
                        "alone (16 to 2048 tokens: the isolated TTFT's step). The last two each profiled by kernel")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    llm = LLM(args.model, dtype=args.dtype, max_model_len=args.max_model_len)
    core, runner = llm.engine.core, llm.engine.runner  # timed as the start-up calibration times it
    model, max_len = core.cost_model, core.max_model_len
    long = min(args.long, max_len - 1)
    errors = {}
    print("decodes x context | chunk after keys | measured ms | predicted ms | error")
    budget = core.config.scheduler.max_num_batched_tokens
    steps = {"mixed": lambda: shapes(long, max_len), "throughput": lambda: throughput_shapes(640, budget),
             "prompts": lambda: [[(0, n)] for n in (16, 64, 128, 256, 512, 2048) if n < max_len]}[args.shapes]()
    for step in steps:
        [(shape, seconds)] = time_steps(runner, [step], repeats=args.repeats)
        predicted = model.predict(shape)
        error = (predicted - seconds) / seconds
        decodes = [c for c, n in step if n == 1]
        chunks = [(c, n) for c, n in step if n > 1]
        context, start, n = (decodes or [0])[0], (chunks or [(0, 0)])[0][0], sum(n for _, n in chunks)
        errors.setdefault((len(decodes), context), []).append(error)
        emit(args.out, bench="step_cost_check", decodes=len(decodes), decode_context=context, chunk_start=start,
             chunk=n, chunks=len(chunks), measured_ms=1e3 * seconds, predicted_ms=1e3 * predicted, error=error)
        print(f"{len(decodes):3d} x {context:6d} | {n:4d} after {start:6d} | {1e3 * seconds:8.2f} | "
              f"{1e3 * predicted:8.2f} | {100 * error:+6.1f}%")
        if args.shapes != "mixed" and runner.device.type == "cuda":
            profile(runner, step)
    print("mean error of the start-up model's prediction, by decodes x context (negative: under-predicts):")
    for (decodes, context), errs in errors.items():
        print(f"  {decodes} x {context:6d}: {100 * statistics.mean(errs):+6.1f}% over {len(errs)} steps")


if __name__ == "__main__":
    main()
