"""``bench flat-latency``: in-process on the tiny model, and over HTTP against the fake server."""

from __future__ import annotations

import json

import pytest
import torch

from .conftest import bench
from .fake_server import Behavior

ROW_KEYS = ("mode", "ttft_alone_ms", "short_alone_ttft_ms", "short_mixed_ttft_ms",
            "long_mixed_ttft_ms", "flatness", "short_alone_ttfts", "short_mixed_ttfts",
            "long_mixed_ttfts", "failed", "errors")


def run(tmp_path, capsys, *argv: str) -> dict:
    out = tmp_path / "flat.json"
    assert bench("flat-latency", *argv, "--output", str(out)) == 0
    table = capsys.readouterr().out
    print(table)  # the numbers, for the record (pytest -s)
    assert "Flat Latency" in table and "flatness" in table
    return json.loads(out.read_text())


@pytest.fixture
def one_thread():
    """On a shared CPU a 2-thread region waits for a descheduled thread at every op: that
    inflates the many small ops of a short prompt far more than a long prompt's big ones."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_in_process_static_batching_shows_flat_latency(tmp_path, capsys, one_thread):
    r = run(tmp_path, capsys, "--modes", "static,continuous,continuous-lanes", "--repeats", "5",
            "--input-lens", "8,4096", "--device", "cpu")
    assert r["kind"] == "flat-latency" and r["target"] == "in-process"
    assert r["input_lens"] == [8, 2048 - 4]  # capped: prompt and 4 output tokens fit the context
    rows = {row["mode"]: row for row in r["rows"]}
    assert list(rows) == ["static", "continuous", "continuous-lanes"]
    for row in rows.values():
        assert all(key in row for key in ROW_KEYS)
        assert row["failed"] == 0 and len(row["short_mixed_ttfts"]) == 5 * 8
        assert row["engine_args"]["max_num_batched_tokens"] == 256
    assert rows["continuous"]["engine_args"]["scheduling_policy"] == "fcfs"
    flat = {mode: row["flatness"] for mode, row in rows.items()}
    print("flatness:", flat)
    # One static batch prefills the 1536-token prompt with the short ones: they wait for it.
    assert flat["static"] > 3.0
    # Continuous batching caps the long prompt's chunk while the short ones wait
    # (long_prefill_token_threshold), so they share its first step instead of queueing.
    assert flat["static"] > 2 * flat["continuous"]
    # Lanes (deadline policy): the short requests go first and the long one is held to the
    # batch lane's share while they run, so their steps are the shortest of all rows.
    assert flat["continuous-lanes"] < flat["continuous"] and flat["continuous-lanes"] < flat["static"]


def test_against_a_server(server, tmp_path, capsys):
    # The fake server prefills one prompt at a time, first come first served: head-of-line blocking.
    server.configure(Behavior(ttft=0.005, itl=0.001, prefill_per_token=0.0002))
    r = run(tmp_path, capsys, "--base-url", server.base_url, "--input-lens", "8,64",
            "--num-short", "4", "--long-len", "500", "--output-len", "2", "--repeats", "1")
    assert r["target"] == "http" and r["model_id"] == "fake-model" and r["device"] is None
    [row] = r["rows"]
    assert row["mode"] == "server" and row["failed"] == 0
    assert [a["input_len"] for a in row["ttft_alone_ms"]] == [8, 64]
    assert row["long_mixed_ttft_ms"] == pytest.approx(500 * 0.2 + 5, rel=0.3)
    assert row["flatness"] > 3.0  # the short prompts waited for the long one's 100 ms prefill
    bodies = server.bodies[-5:]  # the mixed submission: the long prompt reached the server first
    assert len(bodies[0]["prompt"].split()) == 500 and bodies[0]["ignore_eos"] is True
    assert bench("report", str(tmp_path / "flat.json"), "--output", str(tmp_path / "r.html")) == 2
    assert "the report covers serving" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--modes", "static,turbo"], "unknown mode"),
    (["--base-url", "http://127.0.0.1:9", "--max-num-batched-tokens", "64"], "engine flags"),
    (["--long-len", "4000"], "do not fit"),
])
def test_bad_options_exit_2_with_a_message(capsys, argv, message):
    assert bench("flat-latency", *argv) == 2
    assert message in capsys.readouterr().err
