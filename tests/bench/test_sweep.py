from __future__ import annotations

import json

from expresslane.bench.sweep import SaturationRule, saturation_reason


def point(thr, p99=100.0, failed=0, completed=10):
    return {"request_throughput": thr, "p99_e2el_ms": p99, "failed": failed,
            "completed": completed}


def test_saturation_rules():
    rule = SaturationRule()
    assert saturation_reason([point(1)], rule) is None
    assert saturation_reason([point(1), point(2)], rule) is None
    assert "throughput" in saturation_reason([point(1), point(2), point(2.1)], rule)
    assert "P99" in saturation_reason([point(1), point(2, p99=600)], rule)
    assert "failed" in saturation_reason([point(1, failed=1, completed=9)], rule)


def test_sweep_stops_past_the_capacity_of_the_server(result_files):
    # The fake server serves 2 requests at a time: concurrency 4 gains nothing.
    sweep = json.loads(result_files["sweep"].read_text())
    assert sweep["kind"] == "sweep" and sweep["variable"] == "max_concurrency"
    assert sweep["values"] == [1, 2, 4, 8, 16]
    assert [p["max_concurrency"] for p in sweep["results"]] == [1, 2, 4]
    assert sweep["saturated_at"] == 4
    assert "throughput" in sweep["saturation_reason"]
    thr = [p["request_throughput"] for p in sweep["results"]]
    assert thr[1] > 1.6 * thr[0]  # below capacity, load doubles and so does throughput
