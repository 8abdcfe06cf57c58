"""``bench one-batch`` on the built-in tiny model: the result JSON and its meaning."""

from __future__ import annotations

import json

import pytest

from expresslane.config.bench import OneBatchConfig

from .conftest import bench

NUMBERS = ("prefill_latency_ms", "prefill_throughput", "median_decode_step_ms", "decode_throughput",
           "total_latency_ms", "output_throughput", "achieved_bandwidth", "mean_kv_bytes_per_step")
GPU_ONLY = ("peak_bandwidth", "bandwidth_utilization", "floor_step_ms", "fraction_of_floor")


def test_one_batch_json_has_the_fields(tmp_path, capsys):
    out = tmp_path / "one.json"
    assert bench("one-batch", "--batch-size", "3", "--input-len", "20", "--output-len", "6",
                 "--device", "cpu", "--output", str(out)) == 0
    print(capsys.readouterr().out)  # the table, for the record (pytest -s)
    r = json.loads(out.read_text())
    assert r["kind"] == "one-batch" and r["device"] == "cpu" and r["dtype"] == "float32"
    assert (r["batch_size"], r["input_len"], r["output_len"]) == (3, 20, 6)
    assert r["quantization"] == {"method": "none"}
    for key in NUMBERS:
        assert isinstance(r[key], float) and r[key] > 0, key
    for key in GPU_ONLY:  # the floor is a GPU figure
        assert r[key] is None, key
    steps = r["step_latencies_ms"]
    assert len(steps) == 6  # one prefill step, then one decode step per further token
    assert r["prefill_latency_ms"] == steps[0]
    assert abs(r["total_latency_ms"] - sum(steps)) < 1e-6
    assert r["decode_throughput"] > 0 and r["weight_bytes"] > 0 and r["kv_bytes_per_token"] > 0


def test_unknown_quantization_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_:  # the flag's choices (config tree): argparse refuses it
        bench("one-batch", "--quantization", "int8")
    assert exit_.value.code == 2 and "invalid choice: 'int8'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="quantization must be one of"):  # and the config, built in code
        OneBatchConfig(quantization="int8").validate()


def test_quantized_one_batch_reports_accuracy_and_memory(tmp_path, capsys):
    """--quantization fp8 with an FP8 KV cache: timed, then compared with the unquantized model."""
    out, chart = tmp_path / "q.json", tmp_path / "acc.png"
    assert bench("one-batch", "--batch-size", "2", "--input-len", "16", "--output-len", "4", "--device", "cpu",
                 "--quantization", "fp8", "--kv-cache-dtype", "fp8", "--accuracy-trials", "2",
                 "--accuracy-texts", "2", "--accuracy-text-len", "40",
                 "--accuracy-chart", str(chart), "--output", str(out)) == 0
    printed = capsys.readouterr().out
    assert "Top-1 agreement" in printed and "Mean KL" in printed
    q = json.loads(out.read_text())["quantization"]
    assert q["method"] == "fp8" and q["kv_cache_dtype"] == "fp8"
    acc = q["accuracy"]
    assert acc["trials"] == 2 and len(acc["per_trial"]) == 2 and acc["stderr_vs_trials"][0]["trials"] == 2
    assert 0.0 <= acc["top1_agreement"]["mean"] <= 1.0 and acc["top1_agreement"]["stderr"] is not None
    assert acc["kl_divergence"]["mean"] >= 0.0
    mem = acc["memory"]
    assert mem["quantized"]["weight_bytes"] < mem["baseline"]["weight_bytes"]
    assert 4 * mem["quantized"]["kv_bytes_per_token"] == mem["baseline"]["kv_bytes_per_token"]  # float32 -> e4m3
    assert chart.stat().st_size > 10_000
