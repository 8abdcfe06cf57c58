"""lm-evaluation-harness against a real server: `local-completions` runs a multiple-choice
(loglikelihood) task from a local JSONL file, scoring each choice with `echo` + `logprobs`
(issue #39). Its tokenizer is the server's own (`tokenizer_backend=remote`: GET /tokenizer_info
and POST /tokenize, which lm-eval 0.4.13 reads), so nothing is downloaded; its loglikelihoods must
equal the offline engine's prompt logprobs for the same token ids."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from expresslane import SamplingParams

from .conftest import API_KEY

DOCS = [
    {"question": "The capital of France is", "choices": [" Paris", " a fish", " blue"], "answer": 0},
    {"question": "Two plus two equals", "choices": [" four", " seven"], "answer": 0},
    {"question": "The sky on a clear day is", "choices": [" green", " blue", " loud"], "answer": 1},
    {"question": "Water freezes at zero degrees", "choices": [" Celsius", " Kelvin"], "answer": 0},
]
TASK = """task: expresslane_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
"""


def run_lm_eval(server, tmp_path) -> tuple[dict, list[dict]]:
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "tiny_mc.yaml").write_text(TASK.format(data=data))
    out = tmp_path / "out"
    env = {**os.environ, "OPENAI_API_KEY": API_KEY, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(tmp_path / "hf-datasets"), "TOKENIZERS_PARALLELISM": "false"}
    model_args = (f"model=tiny,base_url={server.url}/v1/completions,tokenizer_backend=remote,auth_token={API_KEY},"
                  "num_concurrent=1,max_retries=1")
    proc = subprocess.run([sys.executable, "-m", "lm_eval", "run", "--model", "local-completions", "--model_args",
                           model_args, "--tasks", "expresslane_tiny_mc", "--include_path", str(tasks),
                           "--output_path", str(out), "--log_samples"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    [results] = list(out.rglob("results_*.json"))
    [samples] = list(out.rglob("samples_expresslane_tiny_mc_*.jsonl"))
    return json.loads(results.read_text()), [json.loads(line) for line in samples.read_text().splitlines()]


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split of a (context, continuation) pair into token ids (`TemplateLM._encode_pair`)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    ctx = tokenizer.encode(context, add_special_tokens=False)
    return ctx, whole[len(ctx):]


def arguments(sample: dict) -> list[tuple[str, str]]:
    """A logged sample's requests: (context, continuation) per choice."""
    args = sample["arguments"]  # {"gen_args_0": {"arg_0": context, "arg_1": continuation}, ...}
    return [(a["arg_0"], a["arg_1"]) for a in (args.values() if isinstance(args, dict) else args)]


def test_multiple_choice_task_through_local_completions(server, llm, tmp_path):
    results, samples = run_lm_eval(server, tmp_path)
    assert "acc,none" in results["results"]["expresslane_tiny_mc"]
    assert sorted(s["doc_id"] for s in samples) == list(range(len(DOCS)))
    accs = []
    for s in samples:
        doc = DOCS[s["doc_id"]]
        got = [float(r[0][0]) for r in s["resps"]]  # per choice: (loglikelihood, is_greedy), logged as text
        want = []
        for context, continuation in arguments(s):
            ctx, cont = encode_pair(llm.tokenizer, context, continuation)
            [out] = llm.generate([{"prompt_token_ids": ctx + cont}], SamplingParams(max_tokens=1, prompt_logprobs=0),
                                 use_tqdm=False)
            plp = out.prompt_logprobs
            want.append(sum(plp[i][t].logprob for i, t in enumerate(ctx + cont) if i >= len(ctx)))
        assert len(got) == len(doc["choices"])
        assert got == pytest.approx(want, abs=1e-3)  # a sum over a few tokens, each within float32 tolerance
        acc = float(max(range(len(want)), key=want.__getitem__) == doc["answer"])
        assert s["acc"] == acc
        accs.append(acc)
    assert results["results"]["expresslane_tiny_mc"]["acc,none"] == pytest.approx(sum(accs) / len(accs))
