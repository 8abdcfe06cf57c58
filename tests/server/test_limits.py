"""Request limits (issue #19 item 2): each a flag; over one, a 413/400 that names it, before any tokenizing."""

from __future__ import annotations

import httpx
import pytest

from .conftest import Server


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
