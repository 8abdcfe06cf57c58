"""Result JSON: vLLM's keys and types, strict JSON, same schema for every kind."""

from __future__ import annotations

import json

import pytest

from expresslane.bench.stats import METRICS, STATS

NUMBER = (int, float)
TOP = {
    "kind": str, "date": str, "base_url": str, "endpoint": str, "model_id": str,
    "duration": NUMBER, "completed": int, "failed": int, "failure_reasons": dict,
    "total_input_tokens": int, "total_output_tokens": int, "request_throughput": NUMBER,
    "request_goodput": (*NUMBER, type(None)), "output_throughput": NUMBER,
    "total_token_throughput": NUMBER, "per_class": dict, "slo": dict,
    "input_lens": list, "output_lens": list, "ttfts": list, "itls": list, "latencies": list,
    "start_times": list, "classes": list, "lanes": list, "errors": list,
}
SERVING = {"backend": str, "dataset": str, "num_prompts": int, "request_rate": (*NUMBER, str),
           "burstiness": NUMBER, "max_concurrency": (int, type(None)), "seed": int,
           "alone_ttft_ms": (*NUMBER, type(None)), "goodput_config": (dict, type(None))}
LATENCY = {f"{s}_{m}_ms": NUMBER for m in METRICS for s in STATS}
CLASS = {k: v for k, v in TOP.items() if k in (
    "completed", "failed", "failure_reasons", "total_input_tokens", "total_output_tokens",
    "request_throughput", "request_goodput", "output_throughput")} | LATENCY


def check(obj: dict, schema: dict, where: str) -> None:
    for key, types in schema.items():
        assert key in obj, f"{where}: missing {key}"
        assert isinstance(obj[key], types), f"{where}.{key}: {type(obj[key]).__name__}"
        allowed = types if isinstance(types, tuple) else (types,)
        assert not isinstance(obj[key], bool) or bool in allowed, f"{where}.{key} is a bool"


def check_result(r: dict, where: str) -> None:
    check(r, TOP | LATENCY, where)
    n = r["completed"] + r["failed"]
    for key in ("input_lens", "output_lens", "ttfts", "itls", "latencies", "start_times",
                "classes", "lanes", "errors"):
        assert len(r[key]) == n, f"{where}.{key} has {len(r[key])} entries for {n} requests"
    assert all(isinstance(x, int) for x in r["input_lens"] + r["output_lens"])
    assert all(isinstance(x, float) for x in r["ttfts"] + r["latencies"])
    assert all(isinstance(g, float) for gaps in r["itls"] for g in gaps)
    assert sum(bool(e) for e in r["errors"]) == r["failed"]
    assert sum(r["failure_reasons"].values()) == r["failed"]
    for name, stats in r["per_class"].items():
        check(stats, CLASS, f"{where}.per_class[{name}]")
    slo = r["slo"]
    check(slo, {"passed": bool, "items": list, "signals": dict, "causes": list}, f"{where}.slo")
    for item in slo["items"]:
        check(item, {"metric": str, "op": str, "target": NUMBER, "value": NUMBER,
                     "passed": (bool, type(None)), "note": str}, f"{where}.slo.items")
    for cause in slo["causes"]:
        check(cause, {"cause": str, "evidence": str, "flags": list}, f"{where}.slo.causes")


def load_strict(path) -> dict:
    def reject(token):
        raise ValueError(f"non-standard JSON constant {token}")
    return json.loads(path.read_text(), parse_constant=reject)


def test_serving_result_schema(result_files):
    r = load_strict(result_files["serving"])
    check_result(r, "serving")
    check(r, SERVING, "serving")
    assert r["request_rate"] == "inf" and r["max_concurrency"] == 8
    assert r["goodput_config"] == {"ttft": 80.0, "e2el": 200.0}
    assert 0 < r["request_goodput"] <= r["request_throughput"]
    assert set(r["per_class"]) == {"short", "long"}
    assert r["failed"] == 4 and r["failure_reasons"] == {"HTTP 500": 4}


def test_sweep_and_traffic_results_schema(result_files):
    sweep = load_strict(result_files["sweep"])
    check(sweep, {"variable": str, "values": list, "saturated_at": (*NUMBER, type(None)),
                  "saturation_reason": (str, type(None)), "rule": dict, "results": list},
          "sweep")
    for i, point in enumerate(sweep["results"]):
        check_result(point, f"sweep.results[{i}]")
        check(point, SERVING, f"sweep.results[{i}]")
    traffic = load_strict(result_files["traffic"])
    check_result(traffic, "traffic")
    check(traffic, {"num_users": int, "think_time": NUMBER, "mix": dict,
                    "time_series": dict}, "traffic")


@pytest.mark.parametrize("kind", ["serving", "sweep", "traffic"])
def test_results_load_back(result_files, kind):
    from expresslane.bench.records import load_result
    assert load_result(result_files[kind])["kind"] == kind
