"""``bench flat-latency``: in-process on the tiny model, and over HTTP against the fake server."""

from __future__ import annotations

import json

import pytest

from expresslane.models.presets import tiny_model_dir

from .conftest import bench
from .fake_server import Behavior

ROW_KEYS = ("mode", "ttft_alone_ms", "short_alone_ttft_ms", "short_mixed_ttft_ms",
            "long_mixed_ttft_ms", "flatness", "short_alone_ttfts", "short_mixed_ttfts",
            "long_mixed_ttfts", "short_first_token_vs_long_ms", "failed", "errors")


def run(tmp_path, capsys, *argv: str) -> dict:
    out = tmp_path / "flat.json"
    assert bench("flat-latency", *argv, "--output", str(out)) == 0
    table = capsys.readouterr().out
    print(table)  # the numbers, for the record (pytest -s)
    assert "Flat Latency" in table and "flatness" in table
    return json.loads(out.read_text())


def test_in_process_static_batching_holds_short_prompts_for_the_long_one(tmp_path, capsys):
    # the random tiny preset: the scheduling facts below do not need the trained default's weights
    r = run(tmp_path, capsys, str(tiny_model_dir()), "--modes", "static,continuous,continuous-lanes", "--repeats", "2",
            "--input-lens", "8,2000", "--num-short", "4", "--long-len", "400", "--device", "cpu",
            "--max-model-len", "512", "--disable-tqdm")
    assert r["kind"] == "flat-latency" and r["target"] == "in-process"
    assert r["input_lens"] == [8, 512 - 4]  # capped: prompt and 4 output tokens fit the context
    assert "capped to 508" in r["notices"][0]
    rows = {row["mode"]: row for row in r["rows"]}
    assert list(rows) == ["static", "continuous", "continuous-lanes"]
    for row in rows.values():
        assert all(key in row for key in ROW_KEYS)
        assert row["failed"] == 0 and len(row["short_mixed_ttfts"]) == 2 * 4
        assert row["engine_args"]["max_num_batched_tokens"] == 256
        assert len(row["short_first_token_vs_long_ms"]) == 2 * 4
    assert rows["continuous"]["engine_args"]["scheduling_policy"] == "fcfs"
    assert rows["continuous-lanes"]["engine_args"]["scheduling_policy"] == "deadline"
    # Ordering facts from the engine's step stamps (no wall-clock threshold). One static batch
    # prefills the long prompt with the short ones: every short gets its first token in the
    # long one's step.
    assert all(abs(d) < 1e-6 for d in rows["static"]["short_first_token_vs_long_ms"])
    # Continuous batching chunks the 400-token prompt (256-token budget, a quarter of it for a
    # long prompt while others wait): the short prompts finish first, steps ahead of it.
    for mode in ("continuous", "continuous-lanes"):
        assert all(d < 0 for d in rows[mode]["short_first_token_vs_long_ms"]), mode


def test_against_a_server(server, tmp_path, capsys):
    # The fake server prefills one prompt at a time, first come first served: head-of-line blocking.
    server.configure(Behavior(ttft=0.005, itl=0.001, prefill_per_token=0.0002, max_model_len=300))
    r = run(tmp_path, capsys, "--base-url", server.base_url, "--input-lens", "8,64,500",
            "--num-short", "4", "--long-len", "500", "--output-len", "2", "--repeats", "1",
            "--disable-tqdm")
    assert r["target"] == "http" and r["model_id"] == "fake-model" and r["device"] is None
    assert r["max_model_len"] == 300 and r["long_len"] == 298  # capped to the context, with notices
    assert any("long prompt (500 tokens)" in n for n in r["notices"])
    assert r["prompt_lengths"] == "exact (the server's /tokenize)"
    [row] = r["rows"]
    assert row["mode"] == "server" and row["failed"] == 0
    assert [a["input_len"] for a in row["ttft_alone_ms"]] == [8, 64, 298]
    # Ordering, not timing: the long prompt reached the server first, so under FIFO prefill
    # every short prompt got its first token after it.
    assert all(d > 0 for d in row["short_first_token_vs_long_ms"])
    bodies = server.bodies[-5:]  # the mixed submission: the long prompt reached the server first
    assert len(bodies[0]["prompt"].split()) == 297 and bodies[0]["ignore_eos"] is True
    prompts = [b["prompt"] for b in server.bodies]
    assert len(set(prompts)) == len(prompts)  # every submission, the warm-up too, is fresh
    assert bench("report", str(tmp_path / "flat.json"), "--output", str(tmp_path / "r.html")) == 0


@pytest.mark.parametrize("argv, message", [
    (["--modes", "static,turbo"], "unknown mode"),
    (["--base-url", "http://127.0.0.1:9", "--max-num-batched-tokens", "64"], "engine flags"),
    (["--long-len", "4000"], "do not fit"),
])
def test_bad_options_exit_2_with_a_message(capsys, argv, message):
    assert bench("flat-latency", *argv) == 2
    assert message in capsys.readouterr().err
