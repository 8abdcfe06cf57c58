"""Every HTTP bench subcommand against a real `expresslane serve` (tiny model, 256-token
context, an API key), and the report of what they wrote."""

from __future__ import annotations

import json

import pytest

from server.conftest import MAX_MODEL_LEN, Server

from .conftest import bench
from .test_schema import check_result, load_strict

KEY = "bench-key"


@pytest.fixture(scope="module")
def real_server():
    srv = Server(api_key=KEY).wait_ready()
    yield srv
    srv.stop()


def test_bench_subcommands_against_expresslane_serve(real_server, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    url = ["--base-url", real_server.url, "--disable-tqdm"]
    serving, traffic, flat = tmp_path / "serving.json", tmp_path / "traffic.json", tmp_path / "flat.json"
    # Long prompts of 1000 tokens do not fit the 256-token context: capped, with a notice.
    assert bench("serving", *url, "--dataset", "mixed", "--num-prompts", "12", "--input-len", "16",
                 "--long-input-len", "1000", "--long-threshold", "100", "--output-len", "4",
                 "--concurrency", "4", "--ignore-eos", "--warmup", "4", "--output", str(serving)) == 0
    assert "notice: 2 of 12 prompts were longer than the model's context" in capsys.readouterr().err
    r = load_strict(serving)
    check_result(r, "serving")
    assert r["completed"] == 12 and r["failed"] == 0 and r["max_model_len"] == MAX_MODEL_LEN
    assert r["total_output_tokens"] == 12 * 4 and r["output_counts"] == {"usage": 12}
    # exact lengths from the server's own /tokenize: what it counted is what was asked
    assert sorted(r["input_lens"]) == [16] * 10 + [MAX_MODEL_LEN - 4] * 2
    assert r["prompt_lengths"] == "exact (the server's /tokenize)"
    # fresh prompts: after warm-up and probes, no measured prompt found a cached prefix
    assert r["cached_tokens"] == [0] * 12

    chat = tmp_path / "chat.json"  # the chat template's tokens count against the context too
    assert bench("serving", *url, "--endpoint", "chat", "--num-prompts", "3", "--input-len", "400",
                 "--output-len", "4", "--alone-probes", "0", "--output", str(chat)) == 0
    c = load_strict(chat)
    assert c["failed"] == 0, c["errors"]
    assert c["input_lens"] == [MAX_MODEL_LEN - 4] * 3, c["notices"]  # usage counts the template in

    assert bench("serving", *url, "--dataset", "prefix-repetition", "--num-prompts", "8",
                 "--input-len", "96", "--prefix-len", "64", "--num-prefixes", "2",
                 "--output-len", "2", "--concurrency", "1", "--alone-probes", "0",
                 "--output", str(tmp_path / "prefix.json")) == 0
    p = load_strict(tmp_path / "prefix.json")
    assert p["input_lens"] == [96] * 8
    # the first use of each prefix misses; every later one hits all of it (4 blocks of 16)
    assert p["cached_tokens"][:2] == [0, 0] and p["cached_tokens"][2:] == [64] * 6

    assert bench("traffic", *url, "--num-users", "3", "--duration", "3", "--think-time", "0.1",
                 "--input-len", "16", "--output-len", "4", "--batch-input-len", "64",
                 "--batch-output-len", "4", "--output", str(traffic)) == 0
    t = load_strict(traffic)
    check_result(t, "traffic")
    assert t["completed"] > 0 and t["time_series"] and t["failed"] == 0

    assert bench("flat-latency", *url, "--input-lens", "8,64,1000", "--num-short", "3",
                 "--short-len", "8", "--long-len", "1000", "--repeats", "1",
                 "--output", str(flat)) == 0
    f = json.loads(flat.read_text())
    assert f["target"] == "http" and f["rows"][0]["failed"] == 0
    assert f["long_len"] == MAX_MODEL_LEN - 4 and f["input_lens"] == [8, 64, MAX_MODEL_LEN - 4]

    over = tmp_path / "overhead.json"
    assert bench("server-overhead", *url, "--sequential", "4", "--concurrency", "2", "--rounds", "2",
                 "--warmup", "1", "--output", str(over)) == 0
    o = json.loads(over.read_text())
    assert o["sequential"]["measured"] == 4 and o["concurrent"]["measured"] == 4
    for part in ("http_ttft", "engine_ttft", "overhead"):
        assert o["sequential"][part]["p50"] > 0, part
    # the parts add up: what HTTP adds is what the client waited beyond the engine's TTFT
    seq = o["sequential"]
    assert seq["overhead"]["mean"] == pytest.approx(seq["http_ttft"]["mean"] - seq["engine_ttft"]["mean"])

    monkeypatch.delenv("OPENAI_API_KEY")
    assert bench("serving", *url, "--num-prompts", "1") == 2
    assert "HTTP 401" in capsys.readouterr().err

    html, png = tmp_path / "report.html", tmp_path / "chart.png"
    assert bench("report", str(serving), str(traffic), str(flat), str(over), "--output", str(html)) == 0
    assert "Server Overhead" in html.read_text()
    assert bench("report", str(serving), str(flat), "--output", str(png)) == 0
    assert html.stat().st_size > 10_000 and "data:image/png;base64" in html.read_text()
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
