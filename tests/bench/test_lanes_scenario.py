"""benchmarks/lanes_scenario.py (issue #6's GPU scenario), shrunk to seconds on CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from expresslane.bench.inprocess import MODES


def test_lanes_scenario_script_runs_with_the_bench_mode_names(tmp_path):
    out = tmp_path / "lanes.jsonl"
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "lanes_scenario.py"
    subprocess.run([sys.executable, str(script), "--long-len", "160", "--num-batch", "2",
                    "--batch-len", "32", "--batch-out", "4", "--num-short", "3", "--short-len", "8",
                    "--max-num-batched-tokens", "64", "--out", str(out)], check=True, capture_output=True,
                   timeout=300, env={**os.environ, "EXPRESSLANE_CACHE": str(tmp_path / "cache")})
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["mode"] for r in rows] == ["static", "continuous", "continuous-lanes"]
    assert {r["mode"] for r in rows} <= set(MODES)  # one name per mode, the bench package's
    for r in rows:
        assert r["bench"] == "lanes_scenario" and r["short_mixed_p99_ms"] >= r["short_mixed_p50_ms"] > 0
        assert r["long_growth"] == r["long_mixed_ms"] / r["long_background_ms"]
