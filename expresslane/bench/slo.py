"""SLO verdict on a benchmark result, and when it fails, the likely cause.

Targets are ``metric:value`` items. A metric ending in ``_ms`` is any latency key of
the result (``p99_ttft_ms``...) and must stay *below* its value; a throughput
(``requests_per_min``, ``request_throughput``, ``output_throughput``) must reach it;
``failure_rate`` (failed / all) must not exceed it.

The default (``DEFAULT_SLO``, the one docs/benchmarks.md states) is the background article's
bar -- mean < 500 ms, P99 < 2 s -- on the time to the first token, plus P99 time per
output token < 100 ms (10 tokens/s a stream, faster than people read) and at most 1%
failed. TTFT and TPOT do not grow with the output length, so a run is judged by what
its users wait for, whatever ``--output-len`` it asks; latency statistics cover
successful requests only, so a server that fails fast must not pass on them.

Diagnosis reads only the result's per-request columns, with simple rules (the
diagnosis workflow of the flat-latency article):

  signal            meaning
  ttft_share        mean TTFT / mean E2E latency: how much of the wait is before token 1
  flat_ratio        median TTFT of short prompts / TTFT of a short prompt sent alone
                    (``alone_ttft_ms`` from the probes, else the fastest short TTFT)
  long_block_ratio  median TTFT of short requests that waited while a long prompt was in
                    flight / the same without one (or alone): do others' prompts hold them?
  mean_tpot_ms      time per output token

  cause             rule
  prefill blocking  long_block_ratio >= 2
  queueing          flat_ratio >= 3 and ttft_share >= 0.5, and not prefill blocking
                    (which explains it)
  slow decode       mean_tpot_ms > 50 (under 20 tokens/s), or decode is most of a
                    failing E2E latency
  low throughput    the throughput target failed at enough offered load
  failures          any request failed (the first distinct messages are the evidence)

Each cause comes with advice that fits the run measured: the engine flags that act on
it (expresslane's names, which are vLLM's), and facts of the run itself (all requests
sent at once, lanes sent or not, a client-side concurrency cap, the error kinds seen).
The benchmark cannot see the server's own flags, so advice never assumes them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from expresslane.bench.records import first_errors
from expresslane.config.bench import DEFAULT_SLO

THROUGHPUTS = {"requests_per_min": ("request_throughput", 60.0),
               "request_throughput": ("request_throughput", 1.0),
               "output_throughput": ("output_throughput", 1.0)}
FLAT_RATIO = 3.0
LONG_BLOCK_RATIO = 2.0
TTFT_SHARE = 0.5
SLOW_TPOT_MS = 50.0


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
        found.append(("failures", f"{result['failed']} requests failed: " + "; ".join(
            f"{msg} (x{n})" for msg, n in first_errors(result["errors"], 3))))
    return [{"cause": c, "evidence": e, "flags": advice(c, result)} for c, e in found]


def advice(cause: str, r: dict) -> list[str]:
    """What to try against ``cause``, from the engine's flags and this run's own facts."""
    lanes_sent = any(r.get("lanes") or [])
    all_at_once = r.get("request_rate") == "inf" and not r.get("max_concurrency")
    out: list[str] = []
    if cause == "prefill blocking":
        out.append("--max-num-batched-tokens N: a smaller step budget chunks long prefills, so "
                   "short prompts run between the chunks")
        out.append("this run sent lanes: they act under --scheduling-policy deadline, so serve with it"
                   if lanes_sent else
                   "--class-lanes (short prompts in lane interactive, long ones in lane batch) "
                   "against a server run with --scheduling-policy deadline")
    elif cause == "queueing":
        if all_at_once:
            out.append(f"this run sent all {len(r['errors'])} requests at once (--request-rate inf): "
                       "they queue by design; measure at a --request-rate or --concurrency the "
                       "server can sustain (--sweep-rates finds it)")
        out.append("--max-num-seqs N: more requests per step, if KV memory allows")
        out.append("more replicas, or less offered load")
    elif cause == "slow decode":
        out.append("--max-num-seqs N: fewer streams per step make each step faster")
        out.append("--max-num-batched-tokens N: smaller prefill chunks stall decodes less")
    elif cause == "low throughput":
        if r.get("max_concurrency"):
            out.append(f"this run capped the client at --concurrency {r['max_concurrency']}: "
                       "raise it to offer more load")
        out.append("--max-num-seqs N and --max-num-batched-tokens N: larger batches, more tokens "
                   "a step")
        out.append("more replicas")
    elif cause == "failures":
        kinds = set(r["failure_reasons"])
        if "HTTP 503" in kinds:
            out.append("HTTP 503: the server's admission control refused load (its "
                       "--max-waiting-requests / --max-waiting-tokens); lower the load or add replicas")
        if kinds & {"HTTP 400", "HTTP 413"}:
            out.append("HTTP 400/413: the server refused these requests as invalid; the messages "
                       "above name the field")
        if kinds & {"HTTP 401", "HTTP 403"}:
            out.append("HTTP 401/403: pass the server's key with --api-key (or OPENAI_API_KEY)")
        if "ClientConnectorError" in kinds:
            out.append(f"the server at {r.get('base_url')} could not be reached")
        if not out:
            out.append("the messages above are the server's (or the connection's) own; the "
                       "result's 'errors' list holds every one")
    return out
