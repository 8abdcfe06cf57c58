"""benchmarks/step_cost_check.py (the start-up cost model against the mixed load's step shapes), on CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_every_shape_is_timed_against_the_models_prediction(tmp_path):
    out = tmp_path / "check.jsonl"
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "step_cost_check.py"
    run = subprocess.run([sys.executable, str(script), "--long", "96", "--max-model-len", "128", "--repeats", "1",
                          "--out", str(out)], check=True, capture_output=True, text=True, timeout=300)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    # 1 / 3 / 5 decodes at 128 or 96 keys: only 96 fits the 128-token context; chunks of 16 / 64 after 0 / 24 / 48
    assert {(r["decodes"], r["decode_context"]) for r in rows} == {(1, 96), (3, 96), (5, 96)}
    assert {(r["chunk_start"], r["chunk"]) for r in rows} == {(s, n) for s in (0, 24, 48) for n in (16, 64)}
    assert all(r["measured_ms"] > 0 and r["predicted_ms"] > 0 for r in rows)
    assert "mean error of the start-up model's prediction" in run.stdout
