from __future__ import annotations

import json

import pytest

from expresslane.bench.traffic import assign_lanes, parse_mix


def test_mix_and_lane_assignment():
    mix = parse_mix("interactive:0.8,batch:0.2")
    assert mix == {"interactive": 0.8, "batch": 0.2}
    assert assign_lanes(mix, 10).count("batch") == 2
    assert assign_lanes(parse_mix("a:1,b:1,c:2"), 4) == ["a", "b", "c", "c"]


def test_traffic_produces_a_time_series(result_files, server):
    r = json.loads(result_files["traffic"].read_text())
    assert r["kind"] == "traffic" and r["users_per_lane"] == {"interactive": 2, "batch": 2}
    ts = r["time_series"]
    n = len(ts["t"])
    assert n >= 2 and ts["t"][:2] == [0.0, 1.0]
    for key in ("in_flight", "started", "completed", "errors", "mean_ttft_ms"):
        assert len(ts[key]) == n, key
    assert sum(ts["started"]) == r["completed"] + r["failed"]
    assert sum(ts["completed"]) == r["completed"] and sum(ts["errors"]) == r["failed"] > 0
    # Time-averaged concurrency: never above the users, and it adds up to the time
    # requests spent in flight (failed ones are fast, so E2E latencies cover nearly all).
    assert 1.0 < ts["in_flight"][0] <= 4.0 and max(ts["in_flight"]) <= 4.0
    assert sum(ts["in_flight"]) == pytest.approx(sum(r["latencies"]), rel=0.1)
    assert ts["mean_ttft_ms"][0] is not None
    assert {"lane:interactive", "lane:batch", "short", "long"} <= set(r["per_class"])
    assert r["failure_reasons"] == {"HTTP 500": r["failed"]}
    assert "slo" in r
