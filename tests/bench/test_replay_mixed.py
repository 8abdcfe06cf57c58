"""benchmarks/replay_mixed.py (issue #20's mixed load into the offline engine), shrunk to seconds on CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from expresslane.bench.arrivals import MIXED_SALT, load_arrivals


def test_replay_sends_the_scenarios_arrivals_and_reports_the_simulation_beside(tmp_path):
    out = tmp_path / "replay.jsonl"
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "replay_mixed.py"
    run = subprocess.run([sys.executable, str(script), "--rate", "4", "--duration", "2", "--long-len", "256",
                          "--short-len", "16", "--output-len", "4", "--long-fraction", "0.3", "--seed", "3",
                          "--flag", "scheduling_policy=deadline", "--flag", "max_model_len=512", "--out", str(out)],
                         check=True, capture_output=True, text=True, timeout=300)
    [row] = [json.loads(line) for line in out.read_text().splitlines()]
    sent = load_arrivals(3, MIXED_SALT, 4, 2, 0.3)  # the very schedule `bench scenarios --seed 3` sends
    assert row["requests"] == len(sent) and row["long_prompts"] == sum(long for _, long in sent) > 0
    assert row["flags"] == {"scheduling_policy": "deadline", "max_model_len": 512}
    assert row["short_ttft_p99_ms"] >= row["short_ttft_p50_ms"] > 0 and 0 <= row["good_fraction"] <= 1
    assert row["steps"] > 0 and row["step_seconds_measured"] > 0
    assert set(row["simulated"]) == {"short_ttft_p99_ms", "short_itl_p99_ms", "long_ttft_p50_ms", "good_per_s",
                                     "good_frac"}
    assert "the worst short request" in run.stdout
