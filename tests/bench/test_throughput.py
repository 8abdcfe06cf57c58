"""``bench throughput``: expresslane and transformers generate the same tokens' worth."""

from __future__ import annotations

import json

from .conftest import bench


def test_throughput_counts_every_token_of_both_engines(tmp_path, capsys):
    out = tmp_path / "t.json"
    assert bench("throughput", "--num-prompts", "3", "--input-len", "8", "--output-len", "4",
                 "--hf-batch-size", "2", "--device", "cpu", "--output", str(out)) == 0
    assert "Offline Throughput" in capsys.readouterr().out
    r = json.loads(out.read_text())
    assert r["kind"] == "throughput" and [row["engine"] for row in r["rows"]] == ["expresslane", "transformers"]
    for row in r["rows"]:  # EOS ignored: every prompt gets all its tokens, on both sides
        assert row["output_tokens"] == 3 * 4
        assert row["tokens_per_s"] == row["output_tokens"] / row["seconds"]
    assert bench("report", str(out), "--output", str(tmp_path / "r.html")) == 0
    assert bench("throughput", "--num-prompts", "0") == 2
