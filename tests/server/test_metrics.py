"""Metrics on a live server: errors by status and reason, per-request histograms counted
like request_success, lane SLO gauges; the NVML sampler against a stand-in NVML; every
metric documented in docs/metrics.md."""

from __future__ import annotations

import re
import threading
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from expresslane.engine.core import StepStats
from expresslane.lanes import Lanes
from expresslane.router.metrics import RouterMetrics
from expresslane.server.api_keys import KeyRing
from expresslane.server.gpu_metrics import GpuSampler
from expresslane.server.metrics import Metrics

from .conftest import metric

ROOT = Path(__file__).resolve().parents[2]


def errors(m: dict, status: str, reason: str) -> float:
    return metric(m, "expresslane:request_errors_total", status=status, reason=reason)


def test_every_error_response_is_counted_by_status_and_reason(server):
    h, url = server.headers, server.url
    before = server.metrics()
    cases = [
        (httpx.get(url + "/v1/models"), "401", "invalid_api_key"),
        (httpx.post(url + "/v1/completions", json={"model": "nope", "prompt": "x"}, headers=h), "404",
         "model_not_found"),
        (httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": -1}, headers=h), "400", None),
        (httpx.post(url + "/v1/completions", json={"prompt": "x " * 400}, headers=h), "400",
         "context_length_exceeded"),
        (httpx.get(url + "/no/such/route"), "404", "not_found"),
    ]
    after = server.metrics()
    for r, status, reason in cases:
        assert str(r.status_code) == status, r.text
        reason = reason or r.json()["error"]["code"]
        assert r.json()["error"]["code"] == reason
    expected: dict[tuple[str, str], int] = {}
    for r, status, _ in cases:
        key = (status, r.json()["error"]["code"])
        expected[key] = expected.get(key, 0) + 1
    for (status, reason), n in expected.items():
        assert errors(after, status, reason) - errors(before, status, reason) == n, (status, reason)
    assert metric(after, "expresslane:request_errors_total") - metric(before, "expresslane:request_errors_total") \
        == len(cases)


def test_success_and_request_histograms_count_the_same_requests(server):
    h = server.headers
    name = "expresslane:{}"
    before = server.metrics()
    prompt = "one two three four"
    body = {"prompt": prompt, "max_tokens": 5, "ignore_eos": True, "lane": "batch"}
    r1 = httpx.post(server.url + "/v1/completions", json=body, headers=h, timeout=60).json()
    r2 = httpx.post(server.url + "/v1/completions", json={**body, "n": 2, "temperature": 1.0, "seed": 3},
                    headers=h, timeout=60).json()
    after = server.metrics()

    def d(metric_name: str, **labels: str) -> float:
        return metric(after, name.format(metric_name), lane="batch", **labels) - \
            metric(before, name.format(metric_name), lane="batch", **labels)

    assert d("request_success_total", finished_reason="length") == 2  # two requests, three completions
    for hist in ("e2e_request_latency_seconds", "request_prompt_tokens", "request_generation_tokens",
                 "request_decode_time_seconds", "request_time_per_output_token_seconds"):
        assert d(f"{hist}_count") == 2, hist
    assert d("request_prompt_tokens_sum") == 2 * r1["usage"]["prompt_tokens"]
    assert d("request_generation_tokens_sum") == r1["usage"]["completion_tokens"] + r2["usage"]["completion_tokens"] \
        == 15
    # everywhere: every request counted a success (not aborted) is in every per-request histogram
    for lane in ("interactive", "batch"):
        done = sum(metric(after, "expresslane:request_success_total", lane=lane, finished_reason=r)
                   for r in ("stop", "length"))
        for hist in ("e2e_request_latency_seconds", "request_prompt_tokens", "request_generation_tokens"):
            assert metric(after, f"expresslane:{hist}_count", lane=lane) == done, (lane, hist)


def test_renamed_and_configured_series(server):
    # one request of our own, so the step histograms have samples whatever ran before
    httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=server.headers,
               timeout=60).raise_for_status()
    m = server.metrics()
    assert any(k.startswith("expresslane:iteration_tokens_total_bucket") for k in m)
    assert not any(k.startswith("expresslane:iteration_tokens_bucket") for k in m)
    lanes = Lanes.parse("")  # the defaults
    assert metric(m, "expresslane:lane_slo_ttft_seconds", lane="interactive") == pytest.approx(lanes.interactive.ttft)
    assert metric(m, "expresslane:lane_slo_ttft_seconds", lane="batch") == pytest.approx(lanes.batch.ttft)
    assert metric(m, "expresslane:lane_slo_tpot_seconds", lane="interactive") == pytest.approx(lanes.interactive.tpot)
    # a CPU server: the GPU gauges have no samples, and nothing else minds
    assert not any(k.startswith("expresslane:gpu_") for k in m)
    assert httpx.get(server.url + "/health").status_code == 200


class FakeNVML:
    """NVML's calls for two boards; the second cannot report power (as some boards cannot)."""

    class NVMLError(Exception):
        pass

    def __init__(self):
        self.boards = {"GPU-aaa": (37, 10 << 30, 80 << 30, 250_000), "GPU-bbb": (91, 70 << 30, 80 << 30, None)}
        self.init = self.shutdown = 0

    def nvmlInit(self):
        self.init += 1

    def nvmlShutdown(self):
        self.shutdown += 1

    def nvmlDeviceGetCount(self):
        return len(self.boards)

    def nvmlDeviceGetHandleByIndex(self, i):
        return list(self.boards)[i]

    def nvmlDeviceGetHandleByUUID(self, uuid):
        if uuid not in self.boards:
            raise self.NVMLError("not found")
        return uuid

    def nvmlDeviceGetUtilizationRates(self, h):
        return SimpleNamespace(gpu=self.boards[h][0], memory=0)

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(used=self.boards[h][1], total=self.boards[h][2], free=0)

    def nvmlDeviceGetPowerUsage(self, h):
        if self.boards[h][3] is None:
            raise self.NVMLError("Not Supported")
        return self.boards[h][3]


def samples(metrics: Metrics) -> dict[str, float]:
    out = {}
    for family in metrics.registry.collect():
        for s in family.samples:
            if s.name.startswith("expresslane:gpu_"):
                out[f"{s.name}/{s.labels['gpu']}"] = s.value
    return out


def test_gpu_sampler_sets_the_gauges_from_nvml(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    nvml, metrics = FakeNVML(), Metrics("m")
    sampler = GpuSampler(metrics, interval=3600, nvml=nvml)
    assert sampler.start()
    try:
        assert samples(metrics) == {
            "expresslane:gpu_utilization_perc/0": 0.37, "expresslane:gpu_utilization_perc/1": 0.91,
            "expresslane:gpu_memory_used_bytes/0": 10 << 30, "expresslane:gpu_memory_used_bytes/1": 70 << 30,
            "expresslane:gpu_memory_total_bytes/0": 80 << 30, "expresslane:gpu_memory_total_bytes/1": 80 << 30,
            "expresslane:gpu_power_watts/0": 250.0}  # board 1 has no power reading: no sample, no crash
        nvml.boards["GPU-aaa"] = (80, 11 << 30, 80 << 30, 400_000)
        sampler.sample()
        assert samples(metrics)["expresslane:gpu_utilization_perc/0"] == 0.8
        assert samples(metrics)["expresslane:gpu_power_watts/0"] == 400.0
        assert any(t.name == "expresslane-gpu-metrics" for t in threading.enumerate())
    finally:
        sampler.stop()
    assert nvml.shutdown == 1 and not any(t.name == "expresslane-gpu-metrics" for t in threading.enumerate())


def test_gpu_sampler_follows_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-bbb")
    metrics = Metrics("m")
    sampler = GpuSampler(metrics, interval=3600, nvml=FakeNVML())
    assert sampler.start()
    sampler.stop()
    assert samples(metrics)["expresslane:gpu_utilization_perc/0"] == 0.91  # the one visible board is gpu 0
    assert "expresslane:gpu_utilization_perc/1" not in samples(metrics)


def test_gpu_sampler_without_nvml_is_off():
    class NoDriver(FakeNVML):
        def nvmlInit(self):
            raise FakeNVML.NVMLError("NVML Shared Library Not Found")

    metrics = Metrics("m")
    sampler = GpuSampler(metrics, nvml=NoDriver())
    assert not sampler.start()
    sampler.stop()
    assert samples(metrics) == {}


def test_every_metric_is_documented():
    doc = (ROOT / "docs" / "metrics.md").read_text()
    documented = set(re.findall(r"`(expresslane:[a-z0-9_:]+)`", doc))
    metrics = Metrics("m")
    KeyRing.from_settings("secret", None, metrics.registry)  # the per-key counters join the registry
    families = list(metrics.registry.collect()) + list(RouterMetrics(["http://r"]).registry.collect())
    exposed = {f.name if f.type != "counter" else f.name + "_total" for f in families}
    assert exposed - documented == set(), "undocumented metrics"
    assert {n for n in documented if ":" not in n[len("expresslane:"):]} - exposed \
        == set(), "documented metrics the server does not have"


def test_engine_counters_carry_on_across_an_engine_restart():
    """The engine's counters are cumulative per engine process; a new one starts from 0."""
    metrics = Metrics("m")

    def total(name: str) -> float:
        return metrics.registry.get_sample_value(f"expresslane:{name}_total", {"model_name": "m"})

    metrics.engine_step(StepStats(1, 0, 0.1, prefix_cache_queries=100, prefix_cache_hits=40, num_preemptions=2))
    metrics.engine_stopped()  # the engine died
    metrics.engine_step(StepStats(1, 0, 0.1, prefix_cache_queries=10, prefix_cache_hits=4, num_preemptions=1))
    assert (total("prefix_cache_queries"), total("prefix_cache_hits"), total("num_preemptions")) == (110, 44, 3)


def test_speculative_decoding_counters_on_a_live_server(server):
    """`serve --speculative-method ngram`: a greedy completion that repeats its prompt equals the
    plain server's (the shared `server` fixture), and the proposed / accepted counters move."""
    from openai import OpenAI

    from .conftest import API_KEY, Server

    spec = Server("--speculative-method", "ngram", "--num-speculative-tokens", "4",
                  "--speculative-disable-by-batch-size", "8").wait_ready()
    try:
        prompt = "def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n    return"
        client = OpenAI(base_url=spec.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
        got = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0)
        m = spec.metrics()
        proposed = metric(m, "expresslane:spec_decode_num_draft_tokens_total")
        accepted = metric(m, "expresslane:spec_decode_num_accepted_tokens_total")
        assert proposed > 0 and 0 < accepted <= proposed
        assert metric(m, "expresslane:spec_decode_num_drafts_total") > 0
        assert metric(m, "expresslane:spec_decode_draft_acceptance_rate") == pytest.approx(accepted / proposed)
    finally:
        spec.stop()
    plain = OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
    want = plain.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0)
    assert got.choices[0].text == want.choices[0].text
