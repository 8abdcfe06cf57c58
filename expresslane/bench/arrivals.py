"""When open-loop requests leave: the send schedules of `bench serving` and of the mixed-load
scenarios, as pure functions of their seeds, so a simulation (benchmarks/flat_sim.py) can replay
the very arrivals a measured run had (numpy only: no client imports)."""

from __future__ import annotations

import math

import numpy as np


def arrival_offsets(n: int, rate: float, burstiness: float, seed: int) -> np.ndarray:
    """Send time of each request, seconds after the start (cumulative, so no drift)."""
    if rate <= 0 or burstiness <= 0:
        raise ValueError(f"request rate and burstiness must be positive, got {rate}, {burstiness}")
    if math.isinf(rate):
        return np.zeros(n)
    gaps = np.random.default_rng(seed).gamma(burstiness, 1.0 / (rate * burstiness), n)
    gaps[0] = 0.0  # the first request starts the clock
    return np.cumsum(gaps)


# the scenarios' salts: the mixed run's, and the goodput sweep's first rate's (rate i: + i)
MIXED_SALT, GOODPUT_SALT = 1, 100


def load_arrivals(seed: int, salt: int, rate: float, duration: float, long_fraction: float) -> list[tuple[float, bool]]:
    """A mixed-load run's schedule: (seconds after the start, long prompt?) per request,
    Poisson at `rate` for `duration` seconds."""
    n = max(1, round(rate * duration))
    is_long = np.random.default_rng([seed, salt]).random(n) < long_fraction
    return list(zip(arrival_offsets(n, rate, 1.0, seed + salt).tolist(), is_long.tolist()))
