"""The flat-latency scenarios in simulated time: the real scheduler and policy, each step
lasting what a step-cost model predicts for it (`--cost`; default: one calibrated on an H200,
Llama-3-8B shape). Compares scheduling configurations without a GPU; the GPU run (`gpu.sh
flat`) is the measurement, this is the quick way to see what a policy change does before
spending one.

Per configuration (`--config`, SchedulerConfig fields) it prints: 16 short prompts sent just
after one long prompt, against each alone; the TTFT of a lone prompt of 128, 2048 and the long
length; throughput of 256 requests sent at once; and for each rate, the mixed load of
`expresslane bench scenarios` (the same seeded arrivals) with its short TTFT and ITL p99, long
TTFT p50 and goodput.

`pd_lanes:on` in a configuration runs the two lanes of issue #45 (docs/architecture.md, "Prefill and
decode side by side"): prefill and decode steps at once on a split of the SMs, each step's time
the cost model's prediction times its split's slowdown (`partitions.H100_CURVE`, measured).

    python benchmarks/flat_sim.py --config default= --config fcfs=scheduling_policy:fcfs \
        --config pd=pd_lanes:on
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path

import numpy as np

from expresslane.bench.arrivals import MIXED_SALT, load_arrivals
from expresslane.config import SchedulerConfig
from expresslane.contract import EngineCoreRequest
from expresslane.cost_model.base import StepCostModel, StepShape
from expresslane.cost_model.piecewise import PiecewiseStepCostModel
from expresslane.scheduler.kv_cache import KVCacheManager
from expresslane.scheduler.partitions import SplitPolicy
from expresslane.scheduler.request import Request
from expresslane.scheduler.scheduler import Scheduler
from expresslane.sampling_params import SamplingParams

# The step-cost model the engine calibrated at start-up on one H200 (Llama-3-8B shape, bf16, CUDA
# graphs), as a server publishes it at /load; its run: docs/performance.md, "Flat latency through HTTP".
with open(Path(__file__).with_name("flat_sim_h200.json")) as _f:
    H200 = PiecewiseStepCostModel.from_dict(json.load(_f))

# What the same steps would cost at the H200's floors (expresslane/bench/floors.py), 8B shape: the linear layers
# read 15.0 GB of weights (3.51 ms at 4.27 TB/s) or compute 2 x 7.5e9 FLOP a token at 805
# TFLOP/s (18.6 us), whichever is longer, plus 0.2 ms a step; 128 KiB of KV per decode context
# token at 4.27 TB/s; 2^19 attention FLOP per prefill query-key pair at 75% of 805 TFLOP/s.
# A planning aid ("would the policy meet the bars if the kernels did?"), not a measurement.
_KNOTS = [1, 16, 32, 64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048]
FLOOR = PiecewiseStepCostModel(_KNOTS, [max(3.51e-3, n * 18.6e-6) + 0.2e-3 for n in _KNOTS],
                               k_decode=131072 / 4.27e12, k_prefill=2**19 / (0.75 * 805e12))
COSTS = {"h200": H200, "floor": FLOOR}


# issue #20's workload: shorts of 64 tokens, long prompts of 8192, 64 new tokens each (--short-len etc.)
SHAPE = {"short": 64, "long": 8192, "out": 64}


def request(rid: str, n: int, out: int, t: float, lane: str = "interactive") -> Request:
    rng = random.Random(rid)
    sp = SamplingParams(temperature=0.0, max_tokens=out, ignore_eos=True)
    return Request.from_core_request(
        EngineCoreRequest(rid, [rng.randrange(1, 30000) for _ in range(n)], sp, (0,), t, 0, lane), 65536)


def simulate(config: dict, arrivals: list[Request], model: StepCostModel = H200) -> dict[str, list[float]]:
    """Each request's token times (seconds from t=0). Steps are pipelined as the engine runs them
    (engine/core.py): step N+1 is planned `step_hold_margin_ms` before step N is predicted to end (at
    N's start if N is shorter), runs once N ends, and N's tokens land when it ends; a request
    arriving after the plan waits for the step after."""
    if config.get("pd_lanes") == "on":
        return simulate_lanes(config, arrivals, model)
    now = 0.0
    cfg = SchedulerConfig(**{"max_num_batched_tokens": 2048, "max_num_seqs": 256, **config})
    sched = Scheduler(cfg, KVCacheManager(60_000, 16), clock=lambda: now, cost_model=model)
    todo = sorted(arrivals, key=lambda r: r.arrival_time)
    times: dict[str, list[float]] = {r.request_id: [] for r in arrivals}
    flight = None  # (plan, when it ends)
    while todo or sched.has_unfinished():
        while todo and todo[0].arrival_time <= now:
            sched.add_request(todo.pop(0))
        plan = sched.schedule()
        start = now if flight is None else max(now, flight[1])
        launched = None
        if plan.seqs:
            shape = StepShape.of((s.start_pos, len(s.token_ids)) for s in plan.seqs)
            launched = (plan, start + max(model.predict(shape), 1e-4))
        landed = flight is not None
        if landed:
            for out in sched.update(flight[0], {s.request_id: 5 for s in flight[0].seqs if s.sample}):
                times[out.request_id].extend([flight[1]] * len(out.new_token_ids))
            now = max(now, flight[1])  # (a plan made meanwhile stays at its own time: `start`)
        flight = launched
        if flight is not None:
            now = max(start, flight[1] - cfg.step_hold_margin_ms / 1e3)
        elif not landed:  # nothing ran, nothing landed: idle until the next arrival
            if not todo:
                raise RuntimeError("the scheduler planned nothing while requests were unfinished")
            now = max(now, todo[0].arrival_time)
    return times


def simulate_lanes(config: dict, arrivals: list[Request], model: StepCostModel = H200) -> dict[str, list[float]]:
    """As `simulate`, in two lanes (`run_lanes`)."""
    now = [0.0]
    cfg = SchedulerConfig(**{"max_num_batched_tokens": 2048, "max_num_seqs": 256, **config})
    sched = Scheduler(cfg, KVCacheManager(60_000, 16), clock=lambda: now[0], cost_model=model)
    sched.enable_two_lanes(SplitPolicy(model, cfg.lane_slo["interactive"].tpot))
    return run_lanes(sched, now, arrivals, model)


def run_lanes(sched: Scheduler, now: list[float], arrivals: list[Request], model: StepCostModel,
              check=None) -> dict[str, list[float]]:
    """Each request's token times, a two-lane scheduler's steps each lasting the model's prediction
    times its split's factor (`now[0]`: the scheduler's clock). A prefill step is planned when the
    lane is free, a decode step when the last one lands (no hold margin); decodes wait while a
    prefill holds every SM; while only long prompts wait or run, one lane's steps on every SM.
    `check(sched)` runs after every round of plans."""
    todo = sorted(arrivals, key=lambda r: r.arrival_time)
    times: dict[str, list[float]] = {r.request_id: [] for r in arrivals}
    lanes: dict[str, tuple] = {}  # lane -> (plan, when it ends)

    def shape(seqs) -> StepShape:
        return StepShape.of((s.start_pos, len(s.token_ids)) for s in seqs)

    while todo or sched.has_unfinished():
        while todo and todo[0].arrival_time <= now[0]:
            sched.add_request(todo.pop(0))
        for lane in sorted(lanes, key=lambda k: lanes[k][1]):
            plan, ends = lanes[lane]
            if ends <= now[0]:
                del lanes[lane]
                for out in sched.update(plan, {s.request_id: 5 for s in plan.seqs if s.sample}):
                    times[out.request_id].extend([ends] * len(out.new_token_ids))
        # only long prompts before their first token: one lane's steps on every SM (the engine's way)
        planned = () if None in lanes else (None,) if not lanes and sched.prefill_lane_only() else ("prefill", "decode")
        for lane in planned:
            if lane not in lanes and (lane != "decode" or sched.split.decode_sms):
                plan = sched.schedule(lane)  # a prefill plan picks the split
                factor = {None: 1.0, "prefill": sched.split.prefill_factor, "decode": sched.split.decode_factor}[lane]
                if plan.seqs:
                    lanes[lane] = (plan, now[0] + max(model.predict(shape(plan.seqs)), 1e-4) * factor)
        if check is not None:
            check(sched)
        events = [ends for _, ends in lanes.values()] + ([todo[0].arrival_time] if todo else [])
        if not events:
            if sched.has_unfinished():
                raise RuntimeError("the scheduler planned nothing while requests were unfinished")
            break
        now[0] = max(now[0], min(events))
    return times


def beside_long(config: dict, model: StepCostModel = H200) -> dict[str, float]:
    """16 shorts (64/64) sent 5 ms after one 8192/64 prompt, against each alone."""
    short, long, out = SHAPE["short"], SHAPE["long"], SHAPE["out"]
    shorts = lambda: [request(f"s{i}", short, out, 0.005) for i in range(16)]  # noqa: E731
    alone_s = simulate(config, shorts(), model)
    alone_l = simulate(config, [request("long", long, out, 0.0)], model)
    mixed = simulate(config, [request("long", long, out, 0.0), *shorts()], model)
    ttft = lambda t, ids: statistics.median(t[i][0] - 0.005 for i in ids)  # noqa: E731
    total = lambda t, ids: statistics.median(t[i][-1] - 0.005 for i in ids)  # noqa: E731
    ids = [f"s{i}" for i in range(16)]
    return {"short_ttft_alone_ms": 1e3 * ttft(alone_s, ids), "short_ttft_x": ttft(mixed, ids) / ttft(alone_s, ids),
            "short_total_x": total(mixed, ids) / total(alone_s, ids),
            "long_ttft_alone_ms": 1e3 * alone_l["long"][0], "long_ttft_x": mixed["long"][0] / alone_l["long"][0]}


def arrivals(rate: float, seconds: float, seed: int = 0, long_frac: float = 0.15) -> list[Request]:
    """The schedule `bench scenarios --seed SEED` sends in its mixed run at this rate and duration
    (bench/arrivals.py): a simulated run replays the very arrivals of a measured one."""
    return [request(f"{'long' if long else 'short'}{i}", SHAPE["long" if long else "short"], SHAPE["out"], t)
            for i, (t, long) in enumerate(load_arrivals(seed, MIXED_SALT, rate, seconds, long_frac))]


def mixed_load(config: dict, rate: float, seconds: float = 20.0, seed: int = 0,
               model: StepCostModel = H200) -> dict[str, float]:
    sent = arrivals(rate, seconds, seed)
    return load_figures(simulate(config, sent, model), {r.request_id: r.arrival_time for r in sent}, seconds)[0]


def load_figures(times: dict[str, list[float]], start: dict[str, float],
                 seconds: float) -> tuple[dict[str, float], dict[str, float]]:
    """A mixed load's figures from each request's token times ("short..." and "long..." ids;
    seconds, the clock of `start`) and each one's TTFT. Good: a short request's TTFT <= 100 ms
    and mean TPOT <= 25 ms, a long one's TTFT <= 1 s (issue #20's SLO)."""
    shorts = [i for i in times if i.startswith("short")]
    longs = [i for i in times if i.startswith("long")]
    ttft = {i: times[i][0] - start[i] for i in times}
    itl = [b - a for i in shorts for a, b in zip(times[i], times[i][1:])]
    tpot = {i: (times[i][-1] - times[i][0]) / max(1, len(times[i]) - 1) for i in shorts}
    good = sum(ttft[i] <= 0.1 and tpot[i] <= 0.025 for i in shorts) + sum(ttft[i] <= 1.0 for i in longs)
    return {"short_ttft_p99_ms": 1e3 * float(np.percentile([ttft[i] for i in shorts], 99)),
            "short_itl_p99_ms": 1e3 * float(np.percentile(itl, 99)),
            "long_ttft_p50_ms": 1e3 * float(np.median([ttft[i] for i in longs])) if longs else 0.0,
            "good_per_s": good / seconds, "good_frac": good / len(times)}, ttft


def throughput(config: dict, n: int = 256, prompt: int = 512, out: int = 256, model: StepCostModel = H200) -> float:
    """Output tokens per second for `n` requests sent at once."""
    t = simulate(config, [request(f"r{i}", prompt, out, 0.0) for i in range(n)], model)
    return n * out / max(v[-1] for v in t.values())


def batch_drain(config: dict, n: int = 2000, rate: float = 4.0, model: StepCostModel = H200) -> dict[str, float]:
    """Issue #15's scenario (`benchmarks/batch_drain.py`): `n` batch-lane requests (256 in / 128 out)
    at once, and Poisson interactive shorts (64 / 16) at `rate`/s, against each alone: the shorts'
    TTFT p99 (target <= 1.5x idle) and the batch's output tokens/s (target >= 0.8x alone)."""
    batch = lambda: [request(f"b{i}", 256, 128, 0.0, "batch") for i in range(n)]  # noqa: E731
    alone = simulate(config, batch(), model)
    seconds = max(v[-1] for v in alone.values())
    rng = random.Random(15)
    times, t = [], rng.expovariate(rate)
    while t < seconds:
        times.append(t)
        t += rng.expovariate(rate)
    shorts = lambda: [request(f"i{k}", 64, 16, t) for k, t in enumerate(times)]  # noqa: E731
    idle = simulate(config, shorts(), model)
    during = simulate(config, batch() + shorts(), model)

    def p99(run: dict) -> float:
        return float(np.percentile([run[f"i{k}"][0] - t for k, t in enumerate(times)], 99))

    batch_end = max(during[f"b{i}"][-1] for i in range(n))
    return {"ttft_p99_idle_ms": 1e3 * p99(idle), "ttft_p99_during_ms": 1e3 * p99(during),
            "batch_x": seconds / batch_end, "batch_tok_s": n * 128 / seconds}


def parse_config(text: str) -> tuple[str, dict]:
    name, _, rest = text.partition("=")
    config = {}
    for item in rest.split():
        key, _, value = item.partition(":")
        config[key] = number(value)
    return name, config


def number(value: str) -> int | float | str:
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", action="append", type=parse_config, required=True,
                   help="NAME='key:value key:value' (SchedulerConfig fields, e.g. prefill_stretch:4); repeatable")
    p.add_argument("--rates", type=float, nargs="*", default=[8, 16, 24, 32])
    p.add_argument("--seconds", type=float, default=15.0)
    p.add_argument("--cost", default="h200",
                   help="step costs: h200 (the H200's calibrated model), floor (what the kernels could reach), "
                        "or a JSON file of a model (what a server publishes at /load, `step_cost` in "
                        "flat_acceptance.py's results)")
    p.add_argument("--drain", action="store_true", help="also issue #15's batch drain (2,000 batch requests)")
    p.add_argument("--seed", type=int, default=0, help="the first arrival schedule: `bench scenarios --seed`'s")
    p.add_argument("--seeds", type=int, default=1, help="mixed-load arrival schedules per rate (each line one)")
    p.add_argument("--short-len", type=int, default=SHAPE["short"])
    p.add_argument("--long-len", type=int, default=SHAPE["long"])
    p.add_argument("--output-len", type=int, default=SHAPE["out"])
    args = p.parse_args()
    SHAPE.update(short=args.short_len, long=args.long_len, out=args.output_len)
    if args.cost in COSTS:
        model = COSTS[args.cost]
    else:
        with open(args.cost) as f:
            model = PiecewiseStepCostModel.from_dict(json.load(f))
    for name, config in args.config:
        b = beside_long(config, model)
        print(f"{name}: beside 8k: short TTFT {b['short_ttft_x']:.2f}x (alone {b['short_ttft_alone_ms']:.1f} ms), "
              f"short total {b['short_total_x']:.2f}x, long TTFT {b['long_ttft_x']:.2f}x "
              f"(alone {b['long_ttft_alone_ms']:.0f} ms)")
        lone = {n: 1e3 * simulate(config, [request("x", n, 1, 0.0)], model)["x"][0]
                for n in sorted({128, 2048, SHAPE["long"]})}
        print("   lone TTFT " + ", ".join(f"{n}: {ms:.1f} ms" for n, ms in lone.items())
              + f"; throughput 256 x 512/256: {throughput(config, model=model):,.0f} tok/s")
        if args.drain:
            d = batch_drain(config, model=model)
            print(f"   batch drain: interactive TTFT p99 {d['ttft_p99_during_ms']:.1f} ms "
                  f"({d['ttft_p99_during_ms'] / d['ttft_p99_idle_ms']:.2f}x idle {d['ttft_p99_idle_ms']:.1f}), "
                  f"batch {d['batch_x']:.2f}x alone ({d['batch_tok_s']:,.0f} tok/s alone)")
        for rate, seed in ((r, sd) for r in args.rates for sd in range(args.seed, args.seed + args.seeds)):
            m = mixed_load(config, rate, args.seconds, seed=seed, model=model)
            print(f"   {rate:4.0f} req/s: short TTFT p99 {m['short_ttft_p99_ms']:7.1f} ms, ITL p99 "
                  f"{m['short_itl_p99_ms']:5.1f} ms, long TTFT p50 {m['long_ttft_p50_ms']:7.1f} ms, "
                  f"goodput {m['good_per_s']:5.1f}/s ({100 * m['good_frac']:.0f}%)")


if __name__ == "__main__":
    main()
