from __future__ import annotations

import json

from expresslane.bench.client import ClientOptions
from expresslane.bench.datasets import DatasetSpec
from expresslane.bench.serving import ServingConfig
from expresslane.bench.sweep import SaturationRule, run_sweep, saturation_reason

from .fake_server import Behavior


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
    # The fake server serves 2 requests at a time and refuses more (503): concurrency 4 is the
    # first point where requests fail, whatever the machine's speed.
    sweep = json.loads(result_files["sweep"].read_text())
    assert sweep["kind"] == "sweep" and sweep["variable"] == "max_concurrency"
    assert sweep["values"] == [1, 2, 4, 8, 16]
    assert [p["max_concurrency"] for p in sweep["results"]] == [1, 2, 4]
    assert [p["failed"] for p in sweep["results"][:2]] == [0, 0]
    assert sweep["saturated_at"] == 4 and "failed" in sweep["saturation_reason"]
    assert sweep["results"][2]["failure_reasons"] == {"HTTP 503": sweep["results"][2]["failed"]}


def test_every_sweep_point_draws_its_own_prompts(server):
    server.configure(Behavior(ttft=0.01, itl=0.005))
    cfg = ServingConfig(ClientOptions(server.base_url), DatasetSpec("random", 5, 24, 2),
                        alone_probes=0, disable_tqdm=True)
    run_sweep(cfg, "max_concurrency", [1, 2, 4], SaturationRule(min_gain=-1.0, latency_factor=1e9))
    prompts = [b["prompt"] for b in server.bodies]
    assert len(prompts) == 15 and len(set(prompts)) == 15  # no point resends another's prompts
