from __future__ import annotations

import pytest

from expresslane.bench.records import RequestRecord
from expresslane.bench.stats import distribution, parse_goodput, summarize, summarize_classes


def rec(ttft, latency, output_len, *, input_len=10, lane=None, cls="short", error=""):
    return RequestRecord(input_len, success=not error, output_len=output_len, ttft=ttft,
                         itl=[(latency - ttft) / max(1, output_len - 1)] * (output_len - 1),
                         latency=latency, error=error, length_class=cls, lane=lane)


def test_tpot_excludes_the_first_token():
    r = rec(0.1, 1.0, 10)
    assert r.tpot == pytest.approx(0.1)  # (1.0 - 0.1) / 9
    assert rec(0.1, 0.1, 1).tpot is None  # one token: no TPOT


def test_distribution_keys_and_empty_sample():
    d = distribution([0.001 * i for i in range(1, 101)])
    assert d["mean"] == pytest.approx(50.5) and d["median"] == pytest.approx(50.5)
    assert d["p99"] == pytest.approx(99.01) and d["p50"] == d["median"]
    assert distribution([]) == dict.fromkeys(d, 0.0)


def test_summarize_counts_failures_and_goodput():
    records = [rec(0.05, 0.2, 4), rec(0.2, 0.5, 4), rec(0, 0, 0, error="HTTP 503: busy"),
               rec(0, 0, 0, error="HTTP 503: busy"), rec(0, 0, 0, error="Timeout: x")]
    s = summarize(records, 2.0, parse_goodput("ttft:100,e2el:300"))
    assert (s["completed"], s["failed"]) == (2, 3)
    assert s["failure_reasons"] == {"HTTP 503": 2, "Timeout": 1}
    assert s["request_throughput"] == 1.0 and s["request_goodput"] == 0.5
    assert s["total_output_tokens"] == 8 and s["output_throughput"] == 4.0
    assert s["mean_ttft_ms"] == pytest.approx(125.0)
    assert summarize(records, 2.0)["request_goodput"] is None


def test_classes_by_length_and_lane():
    records = [rec(0.05, 0.1, 2, lane="interactive"), rec(0.5, 0.6, 2, cls="long", lane="batch")]
    classes = summarize_classes(records, 1.0)
    assert set(classes) == {"short", "long", "lane:interactive", "lane:batch"}
    assert classes["long"]["mean_ttft_ms"] == pytest.approx(500.0)


@pytest.mark.parametrize("spec", ["ttft", "foo:10", "ttft:-1"])
def test_bad_goodput(spec):
    with pytest.raises(ValueError):
        parse_goodput(spec)


def test_goodput_accepts_separate_items():
    assert parse_goodput(["ttft:100", "tpot:20,e2el:900"]) == {
        "ttft": 100.0, "tpot": 20.0, "e2el": 900.0}
