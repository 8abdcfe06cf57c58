"""The streaming client measures what the fake server was programmed to do."""

from __future__ import annotations

import json

import pytest

from expresslane.bench.client import ClientOptions, parse_header
from expresslane.bench.datasets import DatasetSpec
from expresslane.bench.serving import ServingConfig, run_serving

from .conftest import bench
from .fake_server import CHAT_TEMPLATE_TOKENS, Behavior


def run(server, behavior: Behavior, dataset: DatasetSpec, opts: dict | None = None, **kw) -> dict:
    server.configure(behavior)
    kw.setdefault("alone_probes", 0)
    return run_serving(ServingConfig(ClientOptions(server.base_url, **(opts or {})), dataset=dataset,
                                     disable_tqdm=True, **kw))


def generation_prompts(server) -> list[str]:
    return [b.get("prompt") or b["messages"][0]["content"] for b in server.bodies]


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_measured_ttft_and_itl_match_programmed(server, endpoint):
    # Warm-up requests open the keep-alive connections, so no TTFT pays a TCP handshake.
    r = run(server, Behavior(ttft=0.1, itl=0.02), DatasetSpec("random", 24, 32, 10),
            {"endpoint": endpoint}, max_concurrency=4, warmup=4)
    assert (r["completed"], r["failed"]) == (24, 0)
    # The server writes token k at t0 + ttft + k * itl (absolute deadlines, t0 after the request
    # arrived): the client can see a token late (a busy machine), never early. Lower bounds only.
    assert min(t for t in r["ttfts"]) >= 0.1
    assert min(r["latencies"]) >= 0.1 + 9 * 0.02
    assert r["mean_tpot_ms"] == pytest.approx((r["mean_e2el_ms"] - r["mean_ttft_ms"]) / 9, rel=1e-6)
    assert r["output_lens"] == [10] * 24 and r["output_counts"] == {"usage": 24}
    assert all(len(gaps) == 9 for gaps in r["itls"])  # the first token is not an ITL
    assert server.bodies[-1]["model"] == "fake-model"  # found through GET /v1/models
    extra = CHAT_TEMPLATE_TOKENS if endpoint == "chat" else 0
    assert r["input_lens"] == [32 + extra] * 24  # the server's usage report: exact, template included
    assert r["prompt_lengths"] == "exact (the server's /tokenize)"


def test_per_token_itl_from_usage_in_every_chunk(server):
    ds = DatasetSpec("random", 6, 16, 9)
    per_token = run(server, Behavior(ttft=0.01, itl=0.01, tokens_per_chunk=3, continuous_usage=True), ds)
    assert server.bodies[0]["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    per_chunk = run(server, Behavior(ttft=0.01, itl=0.01, tokens_per_chunk=3), ds)
    for r in (per_token, per_chunk):
        assert r["output_lens"] == [9] * 6 and r["completed"] == 6
    # 3 chunks of 3 tokens: the first carries TTFT; each later chunk's gap is 3 token gaps
    for gaps in per_token["itls"]:
        assert len(gaps) == 6 and gaps[0] == gaps[1] == gaps[2] and gaps[3] == gaps[4] == gaps[5]
    assert all(len(gaps) == 2 for gaps in per_chunk["itls"])  # without usage: one gap a chunk


def test_output_counts_without_usage(server):
    ds = DatasetSpec("random", 4, 16, 9)
    r = run(server, Behavior(ttft=0.01, itl=0.005, usage=False, tokens_per_chunk=2), ds)
    assert r["output_lens"] == [9] * 4 and r["output_counts"] == {"tokenizer": 4}  # text tokenized
    r = run(server, Behavior(ttft=0.01, itl=0.005, usage=False, tokens_per_chunk=2, tokenize=False), ds)
    assert r["output_lens"] == [5] * 4 and r["output_counts"] == {"chunks": 4}  # the last resort
    assert r["prompt_lengths"].startswith("estimate") and r["input_lens"] == [16] * 4


def test_prompts_are_fresh_for_warmup_probes_and_every_request(server):
    r = run(server, Behavior(ttft=0.01, itl=0.005), DatasetSpec("random", 10, 40, 2),
            warmup=3, alone_probes=3)
    prompts = generation_prompts(server)
    assert len(prompts) == 3 + 3 + 10 and r["completed"] == 10
    assert len({tuple(p.split()[:8]) for p in prompts}) == len(prompts)  # no two share a first block
    assert r["input_lens"] == [40] * 10  # exact, as the server counted them: BOS and 39 words
    assert [len(p.split()) for p in prompts[-10:]] == [39] * 10


def test_context_length_caps_prompts_with_a_notice(server, capsys):
    ds = DatasetSpec("mixed", 10, 16, 8, long_fraction=0.3, long_input_len=1000)
    r = run(server, Behavior(ttft=0.01, itl=0.005, max_model_len=300), ds)
    assert r["failed"] == 0 and r["max_model_len"] == 300
    assert sorted(r["input_lens"]) == [16] * 7 + [292] * 3  # 300 less 8 output tokens
    assert any("3 of 10 prompts" in n and "capped" in n for n in r["notices"])
    assert "notice: 3 of 10 prompts" in capsys.readouterr().err


def test_console_prints_notices_and_the_first_distinct_errors(server, capsys):
    common = ["serving", "--base-url", server.base_url, "--disable-tqdm", "--alone-probes", "0",
              "--num-prompts", "6", "--input-len", "16", "--output-len", "3"]
    server.configure(Behavior(ttft=0.01, itl=0.005, max_model_len=None))
    assert bench(*common) == 0
    out = capsys.readouterr()
    assert "notice: the server did not report its context length" in out.err
    assert "Notice: the server did not report" in out.out and "Errors" not in out.out
    server.configure(Behavior(ttft=0.01, itl=0.005, fail_every=2))
    assert bench(*common) == 0
    out = capsys.readouterr().out
    assert "Errors (first distinct messages)" in out and "x3  HTTP 500: injected failure" in out
    assert "read the server log" not in out


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
    cause = r["slo"]["causes"][-1]
    assert cause["cause"] == "failures" and "HTTP 500: injected failure (x4)" in cause["evidence"]


def test_api_key_headers_extra_body_and_sampling(server, monkeypatch, capsys):
    behavior = Behavior(ttft=0.01, itl=0.005, api_key="sekrit")
    server.configure(behavior)
    common = ["serving", "--base-url", server.base_url, "--disable-tqdm", "--alone-probes", "0",
              "--num-prompts", "2", "--input-len", "8", "--output-len", "2"]
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    assert bench(*common) == 2
    assert "HTTP 401" in (err := capsys.readouterr().err) and "--api-key" in err
    assert bench(*common, "--api-key", "sekrit", "--header", "X-Trace: abc", "--header", "X-B=1",
                 "--temperature", "0.5", "--top-p", "0.9", "--top-k", "7",
                 "--extra-body", '{"top_k": 3, "seed": 11}') == 0
    body, headers = server.bodies[-1], server.headers[-1]
    assert headers["Authorization"] == "Bearer sekrit" and headers["X-Trace"] == "abc"
    assert headers["X-B"] == "1"
    assert (body["temperature"], body["top_p"], body["top_k"], body["seed"]) == (0.5, 0.9, 3, 11)
    assert "min_p" not in body  # not given: the server's default
    monkeypatch.setenv("OPENAI_API_KEY", "sekrit")
    server.configure(behavior)
    assert bench(*common) == 0 and server.headers[-1]["Authorization"] == "Bearer sekrit"
    assert bench(*common, "--extra-body", "[1]") == 2
    assert "JSON object" in capsys.readouterr().err


def test_parse_header_forms():
    assert parse_header("X-A: b:c") == ("X-A", "b:c")
    assert parse_header("X-A=b=c") == ("X-A", "b=c")
    with pytest.raises(ValueError, match="NAME:VALUE"):
        parse_header("novalue")


def test_request_body_carries_options_and_per_request_fields(server, tmp_path):
    path = tmp_path / "prompts.jsonl"
    rows = [{"prompt": "hello there", "lane": "interactive", "priority": 0},
            {"prompt": "summarize " * 50, "output_len": 3, "lane": "batch", "priority": 5},
            {"prompt": "no extras"}]
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    r = run(server, Behavior(ttft=0.01, itl=0.005), DatasetSpec(str(path), output_len=4),
            {"ignore_eos": True}, max_concurrency=1)
    assert r["completed"] == 3
    bodies = {b["prompt"]: b for b in server.bodies}
    assert bodies["hello there"]["lane"] == "interactive"
    assert bodies["hello there"]["priority"] == 0
    assert bodies["summarize " * 50]["max_tokens"] == 3
    assert "lane" not in bodies["no extras"] and "priority" not in bodies["no extras"]
    for body in server.bodies:
        assert body["stream"] is True and body["ignore_eos"] is True
    assert r["output_lens"] == [4, 3, 4]
    assert r["input_lens"] == [3, 51, 3]  # counted exactly by /tokenize (BOS included)
    assert {"lane:interactive", "lane:batch", "short"} <= set(r["per_class"])


def test_alone_probe_measures_ttft_of_idle_server(server):
    r = run(server, Behavior(ttft=0.05, itl=0.01), DatasetSpec("random", 4, 16, 4),
            alone_probes=3)
    # three 2-token probes of the shortest length went first, one at a time; the median TTFT
    # cannot beat the server's programmed 50 ms (a busy machine only adds to it)
    assert [b["max_tokens"] for b in server.bodies] == [2, 2, 2, 4, 4, 4, 4]
    assert r["alone_ttft_ms"] >= 50.0


def test_local_tokenizer_when_the_server_has_none(server, tmp_path):
    from expresslane.models.presets import default_model_dir

    server.configure(Behavior(ttft=0.01, itl=0.005, tokenize=False))
    out = tmp_path / "r.json"
    tok = str(default_model_dir())
    assert bench("serving", "--base-url", server.base_url, "--disable-tqdm", "--alone-probes", "0",
                 "--num-prompts", "3", "--input-len", "50", "--output-len", "2", "--tokenizer", tok,
                 "--output", str(out)) == 0
    r = json.loads(out.read_text())
    assert r["prompt_lengths"] == f"exact (tokenizer {tok})" and r["notices"] == []
    from expresslane.tokenizer import load_tokenizer

    counts = [len(load_tokenizer(tok).encode(b["prompt"])) for b in server.bodies]
    assert counts == [50, 50, 50]  # the lengths asked, as that tokenizer counts them
