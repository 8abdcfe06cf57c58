"""SLO verdict on a benchmark result, and when it fails, the likely cause.

Targets are ``metric:value`` items. A metric ending in ``_ms`` is any latency key of
the result (``p99_ttft_ms``...) and must stay *below* its value; a throughput
(``requests_per_min``, ``request_throughput``, ``output_throughput``) must reach it;
``failure_rate`` (failed / all) must not exceed it. The default is the background
article's bar for a 7B model on one GPU (mean latency < 500 ms, P99 < 2 s, >= 50
requests/min), plus at most 1% failed: latency statistics cover successful requests
only, so a server that fails fast must not pass on them.

Diagnosis reads only the result's per-request columns, with simple rules (the
diagnosis workflow of the flat-latency article):

  signal            meaning
  ttft_share        mean TTFT / mean E2E latency: how much of the wait is before token 1
  flat_ratio        median TTFT of short prompts / TTFT of a short prompt sent alone
                    (``alone_ttft_ms`` from the probes, else the fastest short TTFT)
  long_block_ratio  median TTFT of short requests that waited while a long prompt was in
                    flight / the same without one (or alone): do others' prompts hold them?
  mean_tpot_ms      time per output token

  cause             rule                                         expresslane flags
  prefill blocking  long_block_ratio >= 2                        --max-num-batched-tokens,
                                                                 lanes, priority policy
  queueing          flat_ratio >= 3 and ttft_share >= 0.5, and   --max-num-seqs, lanes,
                    not prefill blocking (which explains it)     priority policy, replicas
  slow decode       mean_tpot_ms > 50 (under 20 tokens/s), or    --max-num-seqs,
                    decode is most of a failing E2E latency      --max-num-batched-tokens
  low throughput    the throughput target failed at enough load  --max-num-seqs,
                                                                 --max-num-batched-tokens
  failures          any request failed                           (reasons listed)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

DEFAULT_SLO = "mean_e2el_ms:500,p99_e2el_ms:2000,requests_per_min:50,failure_rate:0.01"
THROUGHPUTS = {"requests_per_min": ("request_throughput", 60.0),
               "request_throughput": ("request_throughput", 1.0),
               "output_throughput": ("output_throughput", 1.0)}
FLAT_RATIO = 3.0
LONG_BLOCK_RATIO = 2.0
TTFT_SHARE = 0.5
SLOW_TPOT_MS = 50.0

FLAGS = {
    "prefill blocking": [
        "--max-num-batched-tokens N (a smaller step budget chunks long prefills so short "
        "prompts run between the chunks)",
        "lanes: send short requests with lane=interactive, long ones with lane=batch",
        "--scheduling-policy priority (or deadline) so interactive work goes first"],
    "queueing": [
        "--max-num-seqs N (admit more requests per step, if KV memory allows)",
        "--scheduling-policy priority with lanes, so latency-critical requests skip the queue",
        "more replicas, or less offered load"],
    "slow decode": [
        "--max-num-seqs N (fewer streams per step makes each step faster)",
        "--max-num-batched-tokens N (smaller prefill chunks stall decodes less)",
        "do not pass --enforce-eager (CUDA graphs speed up decode steps)"],
    "low throughput": [
        "--max-num-seqs N and --max-num-batched-tokens N (larger batches, more tokens/step)",
        "more replicas"],
    "failures": ["read the server log for the reasons above; 503s mean admission "
                 "control rejected load (add replicas or lower the load)"],
}


@dataclass(frozen=True, slots=True)
class SloTarget:
    metric: str
    limit: float

    @property
    def op(self) -> str:
        if self.metric == "failure_rate":
            return "<="
        return "<" if self.metric.endswith("_ms") else ">="


def parse_slo(spec: str | None) -> tuple[SloTarget, ...]:
    """``metric:value,...`` -> targets; None or "" gives the default."""
    targets = []
    for item in (spec or DEFAULT_SLO).split(","):
        metric, sep, value = item.strip().partition(":")
        if not sep or not (metric.endswith("_ms") or metric in THROUGHPUTS
                           or metric == "failure_rate"):
            raise ValueError(f"bad SLO item {item!r}: expected LATENCY_ms:MS or "
                             f"{'|'.join(THROUGHPUTS)}|failure_rate:VALUE")
        targets.append(SloTarget(metric, float(value)))
    return tuple(targets)


def observed(result: dict, metric: str) -> float:
    if metric == "failure_rate":
        return result["failed"] / max(1, result["completed"] + result["failed"])
    if metric in THROUGHPUTS:
        key, scale = THROUGHPUTS[metric]
        return result[key] * scale
    if metric not in result:
        raise ValueError(f"SLO metric {metric!r} is not in the result")
    return result[metric]


def judge(result: dict, targets: tuple[SloTarget, ...]) -> dict:
    """Pass/fail per target, and the likely causes when any fails."""
    items = [judge_item(result, t) for t in targets]
    passed = result["completed"] > 0 and all(i["passed"] is not False for i in items)
    sig = signals(result)
    return {"passed": passed, "items": items, "signals": sig,
            "causes": [] if passed else causes(result, items, sig)}


def judge_item(result: dict, t: SloTarget) -> dict:
    value = observed(result, t.metric)
    passed = {"<": value < t.limit, "<=": value <= t.limit, ">=": value >= t.limit}[t.op]
    note = ""
    if result["completed"] == 0:
        passed, note = False, "no request completed"
    elif not passed and (offered := offered_load(result, t.metric)) is not None \
            and offered < t.limit:
        # The client asked for less than the target: not the server's failure.
        passed, note = None, f"not judged: offered load {offered:.3g} is below the target"
    return {"metric": t.metric, "op": t.op, "target": t.limit, "value": value,
            "passed": passed, "note": note}


def offered_load(result: dict, metric: str) -> float | None:
    """The request rate the client offered, in ``metric``'s unit; None if unbounded."""
    rate = result.get("request_rate")
    key, scale = THROUGHPUTS.get(metric, ("", 1.0))
    if key != "request_throughput" or rate in (None, "inf"):
        return None
    return float(rate) * scale


def signals(result: dict) -> dict:
    ok = np.array([not e for e in result["errors"]], dtype=bool)
    ttft = np.asarray(result["ttfts"], dtype=float) * 1000.0
    short = ok & (np.asarray(result["classes"]) == "short")
    if not short.any():
        short = ok
    alone = result.get("alone_ttft_ms") or (float(ttft[short].min()) if short.any() else None)
    short_ttft = float(np.median(ttft[short])) if short.any() else None
    mean_e2el = result["mean_e2el_ms"]
    return {
        "ttft_share": result["mean_ttft_ms"] / mean_e2el if mean_e2el > 0 else None,
        "alone_ttft_ms": alone,
        "short_ttft_ms": short_ttft,
        "flat_ratio": short_ttft / alone if short_ttft is not None and alone else None,
        "long_block_ratio": long_block_ratio(result, ok, ttft, alone),
        "mean_tpot_ms": result["mean_tpot_ms"],
    }


def long_block_ratio(result: dict, ok: np.ndarray, ttft_ms: np.ndarray,
                     alone_ms: float | None) -> float | None:
    """How much longer short requests wait when a long prompt shares their wait window."""
    classes = np.asarray(result["classes"])
    start = np.asarray(result["start_times"], dtype=float)
    first = start + ttft_ms / 1000.0
    long_idx = np.flatnonzero(ok & (classes == "long"))
    short_idx = np.flatnonzero(ok & (classes == "short"))
    if not len(long_idx) or not len(short_idx):
        return None
    # Windows [start, first token] overlap: the long prompt was queued or prefilling.
    blocked = np.array([((start[long_idx] < first[i]) & (first[long_idx] > start[i])).any()
                        for i in short_idx])
    if not blocked.any():
        return None
    base = float(np.median(ttft_ms[short_idx[~blocked]])) if (~blocked).any() else alone_ms
    return float(np.median(ttft_ms[short_idx[blocked]])) / base if base else None


def causes(result: dict, items: list[dict], sig: dict) -> list[dict]:
    found: list[tuple[str, str]] = []
    if (r := sig["long_block_ratio"]) is not None and r >= LONG_BLOCK_RATIO:
        found.append(("prefill blocking", f"short requests wait {r:.1f}x longer for their first "
                      "token while a long prompt is in flight"))
    flat, share = sig["flat_ratio"], sig["ttft_share"]
    if (not found and flat is not None and share is not None and flat >= FLAT_RATIO
            and share >= TTFT_SHARE):
        found.append(("queueing", f"short prompts get their first token {flat:.1f}x later than "
                      f"alone ({sig['short_ttft_ms']:.0f} vs {sig['alone_ttft_ms']:.0f} ms); "
                      f"TTFT is {share:.0%} of E2E latency"))
    e2el_failed = any(i["passed"] is False and "e2el" in i["metric"] for i in items)
    tpot = sig["mean_tpot_ms"]
    if tpot > SLOW_TPOT_MS or (e2el_failed and share is not None and share < 1 - TTFT_SHARE):
        found.append(("slow decode", f"mean TPOT {tpot:.1f} ms ({1000 / tpot if tpot else 0:.0f} "
                      f"tokens/s per stream); decode is {1 - (share or 0):.0%} of E2E latency"))
    if any(i["passed"] is False and i["metric"] in THROUGHPUTS for i in items):
        found.append(("low throughput", f"{result['request_throughput'] * 60:.1f} requests/min "
                      "achieved"))
    if result["failed"]:
        reasons = ", ".join(f"{k} x{v}" for k, v in result["failure_reasons"].items())
        found.append(("failures", f"{result['failed']} requests failed: {reasons}"))
    return [{"cause": c, "evidence": e, "flags": FLAGS[c]} for c, e in found]
