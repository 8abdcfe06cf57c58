"""Request limits (issue #19 item 2): each a flag; over one, a 413/400 that names it, before any tokenizing."""

from __future__ import annotations

import httpx
import pytest

from .conftest import MAX_MODEL_LEN, Server


@pytest.fixture(scope="module")
def limited():
    s = Server("--max-request-body-bytes", "4000", "--max-stop-strings", "2", "--max-sequences-per-request", "4",
               "--max-logprobs", "3", "--max-prompt-chars", "500")
    try:
        yield s.wait_ready()
    finally:
        s.stop()


CASES = [  # (path, body, status, param, text in the message)
    ("/v1/completions", {"prompt": "x" * 5000}, 413, None, "--max-request-body-bytes"),
    ("/v1/completions", {"prompt": "x", "stop": ["a", "b", "c"]}, 400, "stop", "--max-stop-strings"),
    ("/v1/completions", {"prompt": ["x", "y", "z"], "n": 2}, 400, "n", "--max-sequences-per-request"),
    ("/v1/completions", {"prompt": "x", "n": 5}, 400, "n", "--max-sequences-per-request"),
    ("/v1/completions", {"prompt": "x", "logprobs": 4}, 400, "logprobs", "--max-logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 4},
     400, "top_logprobs", "--max-logprobs"),
    ("/v1/completions", {"prompt": "word " * 200}, 400, "prompt", "--max-prompt-chars"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w" * 300}] * 2}, 400, "messages",
     "--max-prompt-chars"),
    ("/generate", {"prompt": "x", "stop": ["a", "b", "c"]}, 400, "stop", "--max-stop-strings"),
    ("/tokenize", {"prompt": "w" * 600}, 400, "prompt", "--max-prompt-chars"),
]


@pytest.mark.parametrize("path,body,status,param,text", CASES, ids=[f"{c[0]} {c[4]}" for c in CASES])
def test_over_a_limit_is_refused_naming_it(limited, path, body, status, param, text):
    r = httpx.post(limited.url + path, json=body, headers=limited.headers, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and text in err["message"], err


def test_at_the_limits_a_request_is_served(limited):
    r = httpx.post(limited.url + "/v1/completions", headers=limited.headers, timeout=60,
                   json={"prompt": ["x" * 100, "y"], "n": 2, "stop": ["a", "b"], "logprobs": 3, "max_tokens": 3})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 4
    assert httpx.get(limited.url + "/health").json() == {"status": "ok"}


def test_the_default_prompt_limit_is_what_the_context_could_hold(server):
    """No flag: a prompt longer than max_model_len × the longest token is refused before tokenizing."""
    r = httpx.post(server.url + "/v1/completions", headers=server.headers, timeout=60,
                   json={"prompt": "word " * 400_000})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert "--max-prompt-chars" in r.json()["error"]["message"]


@pytest.mark.parametrize("body,param,text", [
    ({"messages": [{"role": "user", "content": "x"}] * 5000}, "messages", "at least one"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": ""}] * 5000}]}, "messages", "at least one"),
    ({"prompt": "x", "stop_token_ids": [1] * 1_000_000}, "stop_token_ids", "vocabulary"),
    ({"prompt": "x", "stop_token_ids": [1] * 9000}, "stop_token_ids", "vocabulary"),  # a small body (the vocab: 8,192)
], ids=["messages", "content parts", "stop_token_ids", "stop_token_ids, small body"])
def test_a_large_body_with_more_items_than_any_request_needs_is_refused_before_validation(server, body, param, text):
    """More messages and parts than the context has tokens, or more stop token ids than the vocabulary
    has: counted on the decoded body (over 64 KiB), before pydantic builds a model for each."""
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = httpx.post(server.url + path, json=body, headers=server.headers, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and text in r.json()["error"]["message"], r.text
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_the_largest_token_id_batch_is_served(server):
    """Prompts × n at --max-sequences-per-request (256), each one token short of the context: a
    body of about 0.5 MB, decoded once and validated without pydantic's JSON parser. (The prompts
    share all but their last token: the prefix cache keeps the engine's part short.)"""
    prefix = [(i * 7919) % 1000 + 10 for i in range(MAX_MODEL_LEN - 2)]
    ids = [prefix + [10 + j] for j in range(256)]
    r = httpx.post(server.url + "/v1/completions", headers=server.headers, timeout=300,
                   json={"prompt": ids, "max_tokens": 1})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 256


def test_detokenize_takes_at_most_the_context(server):
    """Decoding millions of ids holds the GIL for seconds; no sequence of the model is longer
    than its context. Refused the same way small (validated) and large (pre-checked)."""
    for n in (MAX_MODEL_LEN + 1, 40_000):
        r = httpx.post(server.url + "/detokenize", headers=server.headers, timeout=60, json={"tokens": [5] * n})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tokens", r.text
        assert r.json()["error"]["code"] == "context_length_exceeded"
    r = httpx.post(server.url + "/detokenize", headers=server.headers, timeout=60,
                   json={"tokens": [5] * MAX_MODEL_LEN})
    assert r.status_code == 200, r.text
