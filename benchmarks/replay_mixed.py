"""Issue #20: the mixed load of `bench scenarios` replayed into the offline engine in real time,
without HTTP, next to what the scheduler alone predicts for the same arrivals.

    python benchmarks/replay_mixed.py [--model DIR] [--rate 8 --duration 10] [--flag scheduling_policy=deadline]

The arrivals are the ones `bench scenarios --seed SEED` sends in its mixed run (bench/arrivals.py),
the prompts random token ids of --short-len / --long-len tokens, --output-len new tokens each
(greedy, EOS ignored). Requests enter the engine at their arrival times; it steps while any is
unfinished. Reported, as for the server (`flat_sim.load_figures`): short TTFT p50 / p99, short
inter-token p99, long TTFT p50, goodput (short: TTFT <= 100 ms and mean TPOT <= 25 ms; long:
TTFT <= 1 s); the steps' measured and predicted time; `flat_sim.py`'s figures for the same
arrivals with the model this engine calibrated at start-up and with the model its refits left
at the end; the steps around the worst short request (its prefill chunks, the other chunks,
the decodes, who waited); and the stalls: steps that spent more than STALL_MS in step()
beyond their predicted time, with what ran on the host meanwhile
(a cost-model refit, Python's garbage collector, Triton compiling a kernel).

Where the server's tails match this replay, they come from the engine; where the replay
matches the simulation, from the host or HTTP (the runs: docs/performance.md, "Flat latency
through HTTP").
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import itertools
import random
import time

import numpy as np
from _shared import emit, parse_flag

import flat_sim
from expresslane import LLM, SamplingParams
from expresslane.bench.arrivals import load_arrivals
from expresslane.scheduler.request import RequestStatus
from expresslane.cost_model.piecewise import PiecewiseStepCostModel
from expresslane.models.model_dir import DEFAULT_MODEL


STALL_MS = 30.0


class HostEvents:
    """Host work that can stall a step, timed as it happens: cost-model refits, garbage
    collections, Triton compilations (each a (start, seconds, what) in `events`); and each
    refit the model kept, (start, the model) in `kept`."""

    def __init__(self, core):
        self.events: list[tuple[float, float, str]] = []
        self.kept: list[tuple[float, str]] = []
        self._gc_start = 0.0
        gc.callbacks.append(self._gc)
        model = core.cost_model
        if model is not None:
            refit = model._refit

            def timed_refit():
                t, before = time.monotonic(), model.refits
                refit()
                self.events.append((t, time.monotonic() - t, "refit"))
                if model.refits > before:
                    self.kept.append((t, model.describe()))
            model._refit = timed_refit
        try:
            import triton
            triton.knobs.runtime.jit_post_compile_hook = self._compiled
        except (ImportError, AttributeError):
            pass

    def _gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = time.monotonic()
        else:
            self.events.append((self._gc_start, time.monotonic() - self._gc_start, f"gc{info['generation']}"))

    def _compiled(self, **kw) -> None:
        self.events.append((time.monotonic(), 0.0, "compiled " + str(kw.get("repr", "?")).split("[")[0]))

    def between(self, a: float, b: float) -> list[str]:
        return [f"{what} {1e3 * took:.1f} ms" if took else what for t, took, what in self.events if a <= t < b]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(DEFAULT_MODEL))
    p.add_argument("--dtype", default="auto")
    p.add_argument("--flag", action="append", type=parse_flag, default=[], metavar="KEY=VALUE",
                   help="an engine argument (LLM keyword), e.g. scheduling_policy=deadline; repeatable")
    p.add_argument("--rate", type=float, default=8.0)
    p.add_argument("--duration", type=float, default=10.0)
    p.add_argument("--short-len", type=int, default=64)
    p.add_argument("--long-len", type=int, default=8192, help="cut to the context, less the output")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--long-fraction", type=float, default=0.15)
    p.add_argument("--seed", type=int, default=0, help="`bench scenarios --seed`: the same arrivals")
    p.add_argument("--out", default=None)
    args = p.parse_args()

    llm = LLM(args.model, dtype=args.dtype, **dict(args.flag))
    engine, core = llm.engine, llm.engine.core
    long_len = min(args.long_len, core.max_model_len - args.output_len - 1)
    calibrated = PiecewiseStepCostModel.from_dict(core.cost_model.to_dict()) if core.cost_model else None
    sched_cfg = {f.name: getattr(core.config.scheduler, f.name) for f in dataclasses.fields(core.config.scheduler)}
    vocab = min(core.hf_config.vocab_size, 30000)
    rng = random.Random(args.seed)
    warm = [[rng.randrange(1, vocab) for _ in range(n)] for n in (args.short_len, long_len)]
    llm.generate([{"prompt_token_ids": w} for w in warm], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    # As the server's engine process does after start-up (server/engine_proc.py): the start-up heap
    # out of the collector's reach. Without it a full collection took 229 ms inside one step (H200).
    gc.collect()
    gc.freeze()

    host = HostEvents(core)
    sent = load_arrivals(args.seed, flat_sim.MIXED_SALT, args.rate, args.duration, args.long_fraction)
    names = [f"{'long' if long else 'short'}{i}" for i, (_, long) in enumerate(sent)]
    prompts = [[rng.randrange(1, vocab) for _ in range(long_len if long else args.short_len)] for _, long in sent]
    sp = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    times: dict[str, list[float]] = {}
    steps = []  # (start, seconds in step(), measured, predicted, prefill chunks [(id, n)], decodes, waiting ids)
    t0, i = time.monotonic(), 0
    while i < len(sent) or engine.has_unfinished():
        now = time.monotonic() - t0
        while i < len(sent) and sent[i][0] <= now:
            engine.add_request(names[i], {"prompt_token_ids": prompts[i]}, sp, arrival_time=t0 + sent[i][0])
            i += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, sent[i][0] - now))
            continue
        waiting = [r.request_id for r in core.scheduler.requests.values() if r.status == RequestStatus.WAITING]
        start = time.monotonic()
        outs = engine.step()
        done = time.monotonic()
        for o in outs:
            times.setdefault(o.request_id, []).append(done - t0)
        if core.held:  # nothing launched: the step on the GPU is far from its end
            continue
        stats = core.stats()
        plan = core._in_flight.plan.seqs if core._in_flight else []
        steps.append((start - t0, done - start, stats.step_time, stats.predicted_step_time,
                      [(s.request_id, len(s.token_ids)) for s in plan if len(s.token_ids) > 1],
                      sum(len(s.token_ids) == 1 for s in plan), waiting))
    arrival = {n: t for n, (t, _) in zip(names, sent)}
    measured, ttft = flat_sim.load_figures(times, arrival, args.duration)  # the simulation's own figures
    measured["good_fraction"] = measured.pop("good_frac")
    measured["short_ttft_p50_ms"] = 1e3 * float(np.median([v for r, v in ttft.items() if r.startswith("short")]))
    row = {"bench": "replay_mixed", "model": args.model.rstrip("/").split("/")[-1], "flags": dict(args.flag),
           "rate": args.rate, "duration": args.duration, "requests": len(sent),
           "long_prompts": sum(long for _, long in sent), "long_len": long_len, **measured,
           "steps": len(steps), "step_seconds_in_step": sum(s[1] for s in steps),
           "step_seconds_measured": sum(s[2] for s in steps), "step_seconds_predicted": sum(s[3] for s in steps)}
    if calibrated is not None:  # the scheduler alone, same arrivals, this engine's start-up model
        flat_sim.SHAPE.update(short=args.short_len, long=long_len, out=args.output_len)
        # and with the model as the run left it (when a refit was kept): how much of a gap is the cost level
        ended = PiecewiseStepCostModel.from_dict(core.cost_model.to_dict()) if host.kept else None
        models = {"simulated": calibrated, "simulated_refit": ended}
        for key, model in models.items():
            if model is not None:
                sim = flat_sim.mixed_load(sched_cfg, args.rate, args.duration, seed=args.seed, model=model)
                row[key] = {k: round(v, 2) for k, v in sim.items()}
        row["step_cost"] = calibrated.to_dict()  # for flat_sim.py --cost
    emit(args.out, **row)

    print(f"cost model at start-up: {calibrated.describe() if calibrated else None}")
    for t, text in host.kept:
        print(f"refit kept at {t - t0:.3f} s: {text}")
    print("the long prompts (arrival s, TTFT ms, chunks, their median and smallest tokens, "
          "steps it sat out between its first and last chunk):")
    for name in (n for n in names if n.startswith("long")):
        mine = [(k, n) for k, s in enumerate(steps) for r, n in s[4] if r == name]
        if not mine:
            continue
        sizes = [n for _, n in mine]
        sat_out = mine[-1][0] - mine[0][0] + 1 - len(mine)
        print(f"  {name:8s} {arrival[name]:7.3f} {1e3 * (times[name][0] - arrival[name]):8.1f}  {len(sizes):4d} "
              f"{int(np.median(sizes)):5d} {min(sizes):5d}  {sat_out}")

    worst = max((n for n in times if n.startswith("short")), key=lambda n: times[n][0] - arrival[n])
    t_in, t_first = arrival[worst], times[worst][0]
    print(f"the worst short request, {worst}: arrived at {t_in:.3f} s, first token at {t_first:.3f} s; the steps "
          "started in between (s, ms in step(), prefill chunks (request, tokens), decodes, waiting):")
    around = [s for s in steps if t_in - 0.05 <= s[0] <= t_first]
    for k, (start, wall, _, _, chunks, decodes, waiting) in enumerate(around):
        if k < 20 or k >= len(around) - 20:  # the first and last 20
            print(f"  {start:8.3f} {1e3 * wall:6.1f}  {chunks[:6]}  decodes {decodes}  waiting {waiting[:6]}")
        elif k == 20:
            print(f"  ... {len(around) - 40} steps ...")

    # a call's measured and predicted times are the step it landed: the one the call before launched
    paced = [(prev, cur[2], cur[3]) for prev, cur in itertools.pairwise(steps) if prev[5] and cur[2] > 0]
    if paced:
        ms = np.array([1e3 * m for _, m, _ in paced])
        ratio = np.array([m / p for _, m, p in paced if p > 0])
        print(f"the {len(paced)} timed steps with decodes (what decoding requests wait between tokens): "
              f"ms p50 / p90 / p99 {np.percentile(ms, 50):.1f} / {np.percentile(ms, 90):.1f} / "
              f"{np.percentile(ms, 99):.1f}; measured / predicted p50 / p90 / p99 {np.percentile(ratio, 50):.2f} / "
              f"{np.percentile(ratio, 90):.2f} / {np.percentile(ratio, 99):.2f}; the slowest "
              "(s, ms measured, ms predicted, prefill chunks (request, tokens), decodes):")
        for prev, m, p in sorted(paced, key=lambda x: -x[1])[:10]:
            print(f"  {prev[0]:8.3f} {1e3 * m:6.1f} {1e3 * p:6.1f}  {prev[4][:6]}  decodes {prev[5]}")

    stalls = [s for s in steps if 1e3 * (s[1] - s[3]) > STALL_MS]
    print(f"stalls: {len(stalls)} steps spent > {STALL_MS:.0f} ms in step() beyond their predicted time "
          "(s, ms in step(), ms predicted, host events meanwhile):")
    for start, wall, _, predicted, *_ in stalls[:30]:
        print(f"  {start:8.3f} {1e3 * wall:6.1f} {1e3 * predicted:6.1f}  {host.between(t0 + start, t0 + start + wall)}")


if __name__ == "__main__":
    main()
