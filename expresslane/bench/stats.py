"""Statistics over request records, with ``vllm bench serve``'s keys and meanings.

Latency statistics are in milliseconds and cover successful requests only; counts and
token totals say how many requests that was. An empty sample gives 0.0 (as vLLM),
so always read a statistic together with ``completed``.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from expresslane.bench.records import RequestRecord, per_request_lists

METRICS = ("ttft", "tpot", "itl", "e2el")
STATS = ("mean", "median", "std", "p50", "p90", "p95", "p99")
GOODPUT_METRICS = ("ttft", "tpot", "e2el")


def distribution(values_s: list[float]) -> dict[str, float]:
    """mean/median/std/p50/p90/p95/p99 of a sample given in seconds, in ms."""
    if not values_s:
        return dict.fromkeys(STATS, 0.0)
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    p50, p90, p95, p99 = np.percentile(ms, [50, 90, 95, 99])
    return {
        "mean": float(ms.mean()),
        "median": float(np.median(ms)),
        "std": float(ms.std()),
        "p50": float(p50),
        "p90": float(p90),
        "p95": float(p95),
        "p99": float(p99),
    }


def parse_goodput(items: list[str] | str | None) -> dict[str, float]:
    """``ttft:MS,tpot:MS,e2el:MS`` (commas or separate items) -> {metric: ms}."""
    if not items:
        return {}
    if isinstance(items, str):
        items = [items]
    slos: dict[str, float] = {}
    for item in (p for chunk in items for p in chunk.split(",") if p.strip()):
        name, sep, value = item.partition(":")
        name = name.strip().lower()
        if not sep or name not in GOODPUT_METRICS:
            raise ValueError(f"bad goodput item {item!r}: expected one of "
                             f"{', '.join(m + ':MS' for m in GOODPUT_METRICS)}")
        ms = float(value)
        if ms <= 0:
            raise ValueError(f"goodput target for {name} must be positive, got {value}")
        slos[name] = ms
    return slos


def meets_goodput(r: RequestRecord, goodput: dict[str, float]) -> bool:
    """A request is "good" when it succeeded and met every given target (vLLM: <=)."""
    if not r.success:
        return False
    observed = {"ttft": r.ttft, "tpot": r.tpot or 0.0, "e2el": r.latency}
    return all(observed[m] * 1000.0 <= ms for m, ms in goodput.items())


def summarize(records: list[RequestRecord], duration: float,
              goodput: dict[str, float] | None = None) -> dict:
    """Aggregate statistics of one run (or one class of it) over ``duration`` seconds."""
    ok = [r for r in records if r.success]
    dur = max(duration, 1e-9)
    total_in = sum(r.input_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    out = {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "failure_reasons": dict(Counter(r.error_kind for r in records if not r.success)),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / dur,
        "request_goodput": (sum(meets_goodput(r, goodput) for r in ok) / dur
                            if goodput else None),
        "output_throughput": total_out / dur,
        "total_token_throughput": (total_in + total_out) / dur,
    }
    samples = {
        "ttft": [r.ttft for r in ok],
        "tpot": [t for r in ok if (t := r.tpot) is not None],
        "itl": [gap for r in ok for gap in r.itl],
        "e2el": [r.latency for r in ok],
    }
    for metric in METRICS:
        for stat, value in distribution(samples[metric]).items():
            out[f"{stat}_{metric}_ms"] = value
    return out


def class_keys(r: RequestRecord) -> list[str]:
    """The classes a request is counted in: its length class, and its lane if any."""
    return [r.length_class] + ([f"lane:{r.lane}"] if r.lane else [])


def summarize_classes(records: list[RequestRecord], duration: float,
                      goodput: dict[str, float] | None = None) -> dict[str, dict]:
    """``summarize`` per request class; throughputs share the run's whole duration."""
    groups: dict[str, list[RequestRecord]] = {}
    for r in records:
        for key in class_keys(r):
            groups.setdefault(key, []).append(r)
    return {key: summarize(group, duration, goodput) for key, group in sorted(groups.items())}


def measurement(records: list[RequestRecord], duration: float, t0: float,
                goodput: dict[str, float] | None = None) -> dict:
    """The measured part of every result: totals, classes, per-request columns."""
    return {
        "duration": duration,
        **summarize(records, duration, goodput),
        "per_class": summarize_classes(records, duration, goodput),
        **per_request_lists(records, t0),
    }
