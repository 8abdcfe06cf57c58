"""The streaming client measures what the fake server was programmed to do."""

from __future__ import annotations

import json

import pytest

from expresslane.bench.datasets import DatasetSpec
from expresslane.bench.serving import ServingConfig, run_serving

from .fake_server import CHAT_TEMPLATE_TOKENS, Behavior


def run(server, behavior: Behavior, dataset: DatasetSpec, **kw) -> dict:
    server.configure(behavior)
    kw.setdefault("alone_probes", 0)
    return run_serving(ServingConfig(server.base_url, dataset=dataset, disable_tqdm=True, **kw))


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_measured_ttft_and_itl_match_programmed(server, endpoint):
    # Warm-up requests open the keep-alive connections, so no TTFT pays a TCP handshake.
    r = run(server, Behavior(ttft=0.1, itl=0.02), DatasetSpec("random", 24, 32, 10),
            endpoint=endpoint, max_concurrency=4, warmup=4)
    assert (r["completed"], r["failed"]) == (24, 0)
    for key in ("mean_ttft_ms", "median_ttft_ms"):
        assert r[key] == pytest.approx(100.0, rel=0.05), key
    for key in ("mean_itl_ms", "median_itl_ms", "mean_tpot_ms", "median_tpot_ms"):
        assert r[key] == pytest.approx(20.0, rel=0.05), key
    assert r["mean_e2el_ms"] == pytest.approx(100.0 + 9 * 20.0, rel=0.05)
    assert r["output_lens"] == [10] * 24
    assert all(len(gaps) == 9 for gaps in r["itls"])  # the first token is not an ITL
    assert server.bodies[-1]["model"] == "fake-model"  # found through GET /v1/models
    extra = CHAT_TEMPLATE_TOKENS if endpoint == "chat" else 0
    assert r["input_lens"] == [32 + extra] * 24  # from the server's usage report


def test_failures_are_counted_with_reasons(server):
    r = run(server, Behavior(ttft=0.02, itl=0.01, fail_every=5, drop_every=7),
            DatasetSpec("random", 20, 16, 6), max_concurrency=4)
    assert (r["completed"], r["failed"]) == (14, 6)
    assert r["failure_reasons"] == {"HTTP 500": 4, "ClientPayloadError": 2}
    assert len(r["errors"]) == 20
    assert sum(e.startswith("HTTP 500: injected failure") for e in r["errors"]) == 4
    assert r["request_throughput"] == pytest.approx(14 / r["duration"])
    # Failed requests keep their slot in every column, with zero counts.
    failed = [i for i, e in enumerate(r["errors"]) if e]
    assert all(r["output_lens"][i] == 0 and r["ttfts"][i] == 0.0 for i in failed)
    assert r["slo"]["causes"][-1]["cause"] == "failures"


def test_request_body_carries_options_and_per_request_fields(server, tmp_path):
    path = tmp_path / "prompts.jsonl"
    rows = [{"prompt": "hello there", "lane": "interactive", "priority": 0},
            {"prompt": "summarize " * 50, "output_len": 3, "lane": "batch", "priority": 5},
            {"prompt": "no extras"}]
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    r = run(server, Behavior(ttft=0.01, itl=0.005), DatasetSpec(str(path), output_len=4),
            ignore_eos=True, max_concurrency=1)
    assert r["completed"] == 3
    bodies = {b["prompt"]: b for b in server.bodies}
    assert bodies["hello there"]["lane"] == "interactive"
    assert bodies["hello there"]["priority"] == 0
    assert bodies["summarize " * 50]["max_tokens"] == 3
    assert "lane" not in bodies["no extras"] and "priority" not in bodies["no extras"]
    for body in server.bodies:
        assert body["stream"] is True and body["ignore_eos"] is True
        assert body["stream_options"] == {"include_usage": True}
    assert r["output_lens"] == [4, 3, 4]
    assert {"lane:interactive", "lane:batch", "short"} <= set(r["per_class"])


def test_counts_without_usage_or_tokenize(server):
    r = run(server, Behavior(ttft=0.01, itl=0.005, usage=False, tokens_per_word=None),
            DatasetSpec("random", 6, 20, 5))
    assert r["prompt_lengths"] == "estimate"
    assert r["output_lens"] == [5] * 6  # one content chunk per token
    assert r["input_lens"] == [20] * 6


def test_prompt_lengths_calibrated_by_tokenize(server):
    r = run(server, Behavior(ttft=0.01, itl=0.005, tokens_per_word=1.5),
            DatasetSpec("random", 10, 300, 2, range_ratio=0.5, seed=3))
    assert r["prompt_lengths"] == "tokenize"
    assert r["tokens_per_word"] == pytest.approx(1.5, rel=0.01)
    sent = [len(b["prompt"].split()) for b in server.bodies]
    assert r["input_lens"] == [round(w * 1.5) for w in sent]  # usage, exact
    assert 150 * 0.95 < min(r["input_lens"]) and max(r["input_lens"]) < 450 * 1.05


def test_alone_probe_measures_ttft_of_idle_server(server):
    r = run(server, Behavior(ttft=0.05, itl=0.01), DatasetSpec("random", 4, 16, 4),
            alone_probes=3)
    assert r["alone_ttft_ms"] == pytest.approx(50.0, rel=0.1)
