"""`expresslane batch INPUT -o OUTPUT`: a Batch API file run offline, resumable from its store."""

from __future__ import annotations

import json
import subprocess
import sys

from expresslane import LLM, SamplingParams

ENGINE = ("--num-kv-blocks", "256", "--max-model-len", "128")


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "expresslane.cli.main", "batch", *args, *ENGINE],
                          capture_output=True, text=True, timeout=300)


def test_offline_batch_equals_the_offline_engine_and_resumes_from_its_store(tmp_path):
    rows = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
             "body": {"model": "tiny", "prompt": f"offline prompt {i}", "max_tokens": 5, "temperature": 0.0,
                      "ignore_eos": True}} for i in range(12)]
    rows.append({"custom_id": "too-long", "method": "POST", "url": "/v1/completions",
                 "body": {"model": "tiny", "prompt": "x " * 300, "max_tokens": 5}})
    inp, out, store = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "queue.db"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    r = run(str(inp), "-o", str(out), "--batch-store", f"sqlite:{store}")
    assert r.returncode == 0, r.stderr
    assert "12 succeeded, 1 failed" in r.stderr
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["custom_id"] for x in lines] == [r["custom_id"] for r in rows]  # input order, errors included
    assert lines[-1]["response"]["status_code"] == 400
    assert lines[-1]["response"]["body"]["error"]["code"] == "context_length_exceeded"
    llm = LLM(None, num_kv_blocks=256, max_model_len=128)
    refs = llm.generate([f"offline prompt {i}" for i in range(12)],
                        SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert [x["response"]["body"]["choices"][0]["text"] for x in lines[:12]] == [o.outputs[0].text for o in refs]
    # The same input against the same store: its batch is done, nothing runs again.
    out2 = tmp_path / "again.jsonl"
    r = run(str(inp), "-o", str(out2), "--batch-store", f"sqlite:{store}")
    assert r.returncode == 0, r.stderr
    assert out2.read_text() == out.read_text()


def test_offline_batch_refuses_a_bad_file_with_its_line(tmp_path):
    inp = tmp_path / "bad.jsonl"
    inp.write_text('{"custom_id": "a", "url": "/v1/completions", "body": {}}\n{"custom_id": "a", '
                   '"url": "/v1/completions", "body": {}}\n')
    r = run(str(inp), "-o", str(tmp_path / "out.jsonl"))
    assert r.returncode == 2 and "bad.jsonl:2: line 2: custom_id 'a' appears more than once" in r.stderr
