"""SLO verdicts and causes on hand-built results with known shapes."""

from __future__ import annotations

import pytest

from expresslane.bench.records import RequestRecord
from expresslane.bench.slo import DEFAULT_SLO, judge, parse_slo
from expresslane.bench.stats import measurement

E2E_SLO = "mean_e2el_ms:500,p99_e2el_ms:2000,requests_per_min:50,failure_rate:0.01"


def record(start, ttft, output_len=10, tpot=0.01, input_len=32, cls="short", error=""):
    latency = ttft + tpot * (output_len - 1)
    return RequestRecord(input_len, start, start + latency, not error, output_len, ttft,
                         [tpot] * (output_len - 1), latency, error, cls)


def result(records, duration=10.0, alone_ms=None, rate="inf", slo=E2E_SLO, concurrency=None):
    r = {"kind": "serving", "request_rate": rate, "alone_ttft_ms": alone_ms,
         "max_concurrency": concurrency, "base_url": "http://h", **measurement(records, duration, 0.0)}
    r["slo"] = judge(r, parse_slo(slo))
    return r


def causes(r):
    return [c["cause"] for c in r["slo"]["causes"]]


def test_fast_server_passes():
    r = result([record(i * 0.1, 0.02) for i in range(100)], duration=10.0, alone_ms=20.0)
    assert r["slo"]["passed"] and causes(r) == []
    assert [i["metric"] for i in r["slo"]["items"]] == [
        "mean_e2el_ms", "p99_e2el_ms", "requests_per_min", "failure_rate"]
    assert all(i["passed"] for i in r["slo"]["items"])


def test_default_slo_judges_per_token_latency_whatever_the_output_length():
    assert DEFAULT_SLO == "mean_ttft_ms:500,p99_ttft_ms:2000,p99_tpot_ms:100,failure_rate:0.01"
    # 128 tokens at 15 ms each: 2 s end to end, which an E2E bar of 500 ms would fail.
    r = result([record(i * 0.5, 0.08, output_len=128, tpot=0.015) for i in range(40)],
               duration=20.0, alone_ms=60.0, slo=None)
    assert r["mean_e2el_ms"] > 1900 and r["slo"]["passed"], r["slo"]["items"]


def test_queueing_short_prompts_wait_for_a_slot():
    # Uniform short prompts, first tokens ~30x later than alone: a queue, not prefill.
    r = result([record(i * 0.1, 0.6 + 0.001 * i) for i in range(100)], alone_ms=20.0)
    assert not r["slo"]["passed"]
    assert causes(r) == ["queueing"]
    assert r["slo"]["signals"]["flat_ratio"] > 25
    flags = " ".join(r["slo"]["causes"][0]["flags"])
    assert "--max-num-seqs" in flags and "all 100 requests at once" in flags
    paced = result([record(i * 0.1, 0.6 + 0.001 * i) for i in range(100)], alone_ms=20.0, rate=10.0)
    assert "at once" not in " ".join(paced["slo"]["causes"][0]["flags"])  # not a fact of that run


def test_prefill_blocking_short_requests_stuck_behind_long_prompts():
    records = []
    for k in range(10):  # every second, a long prompt and short ones caught behind it
        t = 10.0 * k
        records.append(record(t, 0.9, input_len=8000, cls="long"))
        records += [record(t + 0.1 + 0.1 * i, 0.8 - 0.1 * i) for i in range(5)]
        records += [record(t + 5.0 + 0.5 * i, 0.02) for i in range(4)]  # alone: fast
    r = result(records, duration=100.0, alone_ms=20.0, slo="p99_ttft_ms:200")
    assert not r["slo"]["passed"]
    assert causes(r) == ["prefill blocking"]
    assert r["slo"]["signals"]["long_block_ratio"] > 10
    flags = r["slo"]["causes"][0]["flags"]
    assert any("--max-num-batched-tokens" in f for f in flags)
    assert any("--class-lanes" in f for f in flags)  # this run sent no lanes


def test_slow_decode_advice_cites_no_flag_the_run_cannot_know():
    r = result([record(i * 0.1, 0.03, output_len=20, tpot=0.08) for i in range(100)],
               alone_ms=25.0)
    assert causes(r) == ["slow decode"]
    assert "TPOT 80.0 ms" in r["slo"]["causes"][0]["evidence"]
    flags = " ".join(r["slo"]["causes"][0]["flags"])
    assert "--max-num-seqs" in flags and "enforce-eager" not in flags  # the server's flags are unseen


def test_failures_fail_the_verdict_with_reasons():
    records = [record(i * 0.1, 0.02) for i in range(95)]
    records += [record(0, 0, 0, error="HTTP 503: overloaded") for _ in range(5)]
    r = result(records, alone_ms=20.0)
    failed = [i["metric"] for i in r["slo"]["items"] if i["passed"] is False]
    assert failed == ["failure_rate"]
    cause = r["slo"]["causes"][0]
    assert causes(r) == ["failures"] and "HTTP 503: overloaded (x5)" in cause["evidence"]
    assert any("admission control" in f for f in cause["flags"])
    assert not any("400" in f or "reached" in f for f in cause["flags"])  # no such failure here


def test_throughput_not_judged_when_offered_load_is_below_target():
    r = result([record(i * 2.0, 0.02) for i in range(10)], duration=20.0, rate=0.5)
    item = next(i for i in r["slo"]["items"] if i["metric"] == "requests_per_min")
    assert item["passed"] is None and "offered load 30" in item["note"]
    assert r["slo"]["passed"]


def test_no_completed_request_fails_everything():
    r = result([record(0, 0, 0, error="ClientConnectorError: refused")])
    assert not r["slo"]["passed"]
    assert all(i["passed"] is False for i in r["slo"]["items"])


@pytest.mark.parametrize("spec", ["mean_e2el:500", "p99_ttft_ms", "qps:3"])
def test_bad_slo_spec(spec):
    with pytest.raises(ValueError, match="bad SLO item"):
        parse_slo(spec)


def test_diagnoses_prefill_blocking_on_a_fifo_prefill_server(server):
    """End to end: a server that prefills one prompt at a time (FCFS), 0.1 ms per token."""
    from expresslane.bench.client import ClientOptions
    from expresslane.bench.datasets import DatasetSpec
    from expresslane.bench.serving import ServingConfig, run_serving

    from .fake_server import Behavior

    server.configure(Behavior(ttft=0.005, itl=0.005, prefill_per_token=1e-4))
    r = run_serving(ServingConfig(
        ClientOptions(server.base_url), dataset=DatasetSpec("mixed", 40, 16, 4, long_fraction=0.2,
                                             long_input_len=2000, seed=1),
        request_rate=40.0, slo="p99_ttft_ms:100", disable_tqdm=True))
    assert r["failed"] == 0 and not r["slo"]["passed"]
    # Cannot flake on a slow machine: a short prompt queued behind a 2,000-token one waits for
    # its 200 ms prefill (an ordering of the fake server), the others ~7 ms; load delays both.
    assert r["slo"]["signals"]["long_block_ratio"] >= 2
    assert causes(r) == ["prefill blocking"]  # it explains the queue, so no "queueing"
