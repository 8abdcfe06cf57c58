"""Closed-loop traffic: simulated users that send, wait for the reply, think, repeat.

Unlike the open-loop serving benchmark, load here reacts to latency, as real users
do: a slow server gets fewer requests. Each user belongs to one lane of the mix
(``interactive:0.8,batch:0.2``) for the whole run; lane ``batch`` sends the batch
lengths, every other lane the interactive ones, and the lane name travels in the
request body. Think times are exponential with the given mean (seeded per user).
No request starts after ``duration``; those in flight are waited for. Each request's
prompt is fresh (drawn, with its exact length, just before it is sent).

The result holds the serving statistics (per lane and length class too) and a time
series in 1-second buckets: requests in flight (time-averaged), started, completed,
errors, and the mean TTFT of the first tokens that arrived in the bucket.
"""

from __future__ import annotations

import asyncio
import math
import time
from datetime import datetime

import numpy as np
from tqdm import tqdm

from expresslane.bench import client, slo
from expresslane.bench.client import Endpoint
from expresslane.bench.datasets import DatasetSpec, Shape, fit_context, shape, uniform_lengths
from expresslane.bench.records import RequestRecord
from expresslane.bench.serving import chat_overhead, connect, run_facts
from expresslane.bench.stats import measurement
from expresslane.bench.tables import notify
from expresslane.config.bench import TrafficConfig


def parse_mix(spec: str) -> dict[str, float]:
    """``lane:weight,...`` -> lane fractions summing to 1."""
    weights: dict[str, float] = {}
    for item in spec.split(","):
        lane, sep, weight = item.strip().partition(":")
        if not lane or not sep or float(weight) < 0:
            raise ValueError(f"bad mix item {item!r}: expected LANE:WEIGHT")
        weights[lane] = float(weight)
    total = sum(weights.values())
    if total <= 0:
        raise ValueError(f"mix weights must sum to more than 0: {spec!r}")
    return {lane: w / total for lane, w in weights.items()}


def assign_lanes(mix: dict[str, float], num_users: int) -> list[str]:
    """User u takes the lane whose cumulative-fraction bin holds (u + 0.5) / num_users."""
    edges = np.cumsum(list(mix.values()))
    lanes = list(mix)
    return [lanes[min(int(np.searchsorted(edges, (u + 0.5) / num_users)), len(lanes) - 1)]
            for u in range(num_users)]


def time_series(records: list[RequestRecord], t0: float, duration: float) -> dict:
    n = max(1, math.ceil(max([duration] + [r.end - t0 for r in records])))
    start = np.array([r.start - t0 for r in records])
    end = np.array([r.end - t0 for r in records])
    ok = np.array([r.success for r in records], dtype=bool)
    first = start + np.array([r.ttft for r in records])
    ttft_ms = np.array([r.ttft * 1000.0 for r in records])
    edges = np.arange(n + 1, dtype=float)
    series: dict[str, list] = {"t": edges[:-1].tolist(), "in_flight": [], "mean_ttft_ms": []}
    for b in range(n):
        # Time-averaged concurrency: request-seconds spent in flight inside the bucket.
        overlap = np.clip(np.minimum(end, b + 1) - np.maximum(start, b), 0.0, None)
        series["in_flight"].append(float(overlap.sum()))
        got_first = ok & (first >= b) & (first < b + 1)
        series["mean_ttft_ms"].append(float(ttft_ms[got_first].mean()) if got_first.any() else None)
    series["started"] = np.histogram(start, edges)[0].tolist()
    series["completed"] = np.histogram(end[ok], edges)[0].tolist()
    series["errors"] = np.histogram(end[~ok], edges)[0].tolist()
    return series


def lane_lengths(cfg: TrafficConfig, ep: Endpoint, overhead: int) -> tuple[dict, list[str]]:
    """Lane -> (input, output) lengths, capped so that the longest draw fits the context."""
    lanes = {"interactive": (cfg.input_len, cfg.output_len),
             "batch": (cfg.batch_input_len, cfg.batch_output_len)}
    notices: list[str] = []
    for lane, (i, o) in lanes.items():
        top_in, top_out = int(i * (1 + cfg.range_ratio)), int(o * (1 + cfg.range_ratio))
        [fitted], said = fit_context([Shape(top_in, top_out)], ep.max_model_len, overhead)
        if ep.max_model_len is None:
            notices = said
        elif fitted.input_len < top_in:
            lanes[lane] = (max(1, int(fitted.input_len / (1 + cfg.range_ratio))), o)
            notices.append(f"lane {lane}: prompts of {i} tokens do not fit the model's context "
                           f"({ep.max_model_len}) with {top_out} output tokens: capped to "
                           f"{lanes[lane][0]}")
    return lanes, notices


async def simulate(cfg: TrafficConfig) -> dict:
    if cfg.num_users < 1 or cfg.duration <= 0 or cfg.think_time < 0:
        raise ValueError("need num_users >= 1, duration > 0 and think_time >= 0")
    mix, slo_targets = parse_mix(cfg.mix), slo.parse_slo(cfg.slo)
    lanes = assign_lanes(mix, cfg.num_users)
    spec = DatasetSpec(long_threshold=cfg.long_threshold)
    records: list[RequestRecord] = []
    async with client.make_session() as session:
        ep, maker, notices = await connect(session, cfg.client)
        lengths, more = lane_lengths(cfg, ep, await chat_overhead(ep, maker))
        notices += more
        for line in notices:
            notify(line)
        bar = tqdm(total=round(cfg.duration), disable=cfg.disable_tqdm, unit="s",
                   desc="traffic", bar_format="{l_bar}{bar}| {n}/{total} s, {postfix}")

        async def user(uid: int, lane: str, deadline: float) -> None:
            rng = np.random.default_rng([cfg.seed, uid])
            in_len, out_len = lengths["batch" if lane == "batch" else "interactive"]
            while time.perf_counter() < deadline:
                n_in = int(uniform_lengths(rng, in_len, cfg.range_ratio, 1)[0])
                n_out = int(uniform_lengths(rng, out_len, cfg.range_ratio, 1)[0])
                s = shape(spec, n_in, n_out, lane=lane)
                text, n = await maker.prompt(rng, n_in)  # drawn before the clock starts
                records.append(await client.send_request(session, ep, text, n, n_out,
                                                         s.length_class, s.lane))
                think = rng.exponential(cfg.think_time) if cfg.think_time else 0.0
                await asyncio.sleep(min(think, max(0.0, deadline - time.perf_counter())))

        async def ticker(t0: float) -> None:
            while (left := t0 + cfg.duration - time.perf_counter()) > 0:
                await asyncio.sleep(min(1.0, left))
                bar.n = min(bar.total, round(time.perf_counter() - t0))
                bar.set_postfix_str(f"{len(records)} requests done")

        t0 = time.perf_counter()
        deadline = t0 + cfg.duration
        await asyncio.gather(ticker(t0), *(user(u, lane, deadline) for u, lane in enumerate(lanes)))
        elapsed = time.perf_counter() - t0
        bar.close()
        await maker.recount_outputs(records)
    records.sort(key=lambda r: r.start)
    result = {
        "kind": "traffic",
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        **run_facts(ep, maker, notices, records),
        "num_users": cfg.num_users,
        "duration_config": cfg.duration,
        "think_time": cfg.think_time,
        "mix": mix,
        "lane_lengths": {lane: {"input_len": i, "output_len": o} for lane, (i, o) in lengths.items()},
        "users_per_lane": {lane: lanes.count(lane) for lane in mix},
        "seed": cfg.seed,
        "time_series": time_series(records, t0, cfg.duration),
        **measurement(records, elapsed, t0),
    }
    result["slo"] = slo.judge(result, slo_targets)
    return result


def run_traffic(cfg: TrafficConfig) -> dict:
    """Simulate ``num_users`` closed-loop users for ``duration`` seconds."""
    return asyncio.run(simulate(cfg))
