"""Sweep the offered load (request rates or concurrencies) until past saturation.

Points run from lightest to heaviest load on requests of the same shapes, each point
with prompts of its own (no point hits the prefix cache on an earlier point's prompts). After each point the
run stops when that point is *past saturation*, by the first rule that holds:

1. failures: more than ``max_failure_rate`` of its requests failed;
2. throughput plateau: its achieved request throughput is less than
   ``1 + min_gain`` times the best of the lighter points (the load grew, the server
   did not deliver more);
3. latency blow-up: its P99 end-to-end latency is more than ``latency_factor`` times
   that of the lightest point (requests queue instead of being served).

The saturating point is kept in the result: it shows the knee of the curve.
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict

from expresslane.bench import client
from expresslane.bench.serving import prepare, run_point
from expresslane.config.bench import SaturationRule, ServingConfig

VARIABLES = ("request_rate", "max_concurrency")


def saturation_reason(points: list[dict], rule: SaturationRule) -> str | None:
    """Why the last point is past saturation, or None while the server keeps up."""
    last = points[-1]
    total = last["completed"] + last["failed"]
    if total and last["failed"] / total > rule.max_failure_rate:
        return f"{last['failed']}/{total} requests failed (> {rule.max_failure_rate:.0%})"
    if len(points) < 2:
        return None
    best = max(p["request_throughput"] for p in points[:-1])
    if last["request_throughput"] < (1 + rule.min_gain) * best:
        return (f"throughput {last['request_throughput']:.2f} req/s is less than "
                f"{1 + rule.min_gain:.2f}x the best lighter point ({best:.2f} req/s)")
    base = points[0]["p99_e2el_ms"]
    if base > 0 and last["p99_e2el_ms"] > rule.latency_factor * base:
        return (f"P99 E2E latency {last['p99_e2el_ms']:.0f} ms is more than "
                f"{rule.latency_factor:g}x the lightest load's ({base:.0f} ms)")
    return None


async def sweep(cfg: ServingConfig, variable: str, values: list[float],
                rule: SaturationRule) -> dict:
    if variable not in VARIABLES:
        raise ValueError(f"sweep variable must be one of {', '.join(VARIABLES)}, got {variable!r}")
    if not values or min(values) <= 0:
        raise ValueError(f"sweep values must be positive, got {values}")
    values = sorted(values)
    points: list[dict] = []
    reason = None
    async with client.make_session() as session:
        prep = await prepare(cfg, session)
        for i, value in enumerate(values):  # each point draws its own prompts (salt i)
            if variable == "request_rate":
                point = await run_point(cfg, prep, value, cfg.max_concurrency, salt=i)
            else:
                point = await run_point(cfg, prep, cfg.request_rate, int(value), salt=i)
            points.append(point)
            if reason := saturation_reason(points, rule):
                break
    return {
        "kind": "sweep",
        "variable": variable,
        "values": values,
        "saturated_at": values[len(points) - 1] if reason else None,
        "saturation_reason": reason,
        "rule": asdict(rule),
        "results": points,
    }


def run_sweep(cfg: ServingConfig, variable: str, values: list[float],
              rule: SaturationRule = SaturationRule()) -> dict:
    """Serving benchmarks at increasing load, stopping once past saturation."""
    return asyncio.run(sweep(cfg, variable, values, rule))
