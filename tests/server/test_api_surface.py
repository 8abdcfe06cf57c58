"""The rest of the OpenAI/vLLM surface real clients touch: HEAD on GET routes, an echoed
X-Request-Id, CORS, /tokenizer_info (lm-eval's remote tokenizer), chat template controls, and
OpenAI's own defaults sent explicitly."""

from __future__ import annotations

import httpx
import pytest

from .conftest import Server

MSG = [{"role": "user", "content": "Hi"}]


def _post(server, path, body, **kw):
    return httpx.post(server.url + path, headers={**server.headers, **kw.pop("headers", {})}, json=body, timeout=30,
                      **kw)


@pytest.mark.parametrize("path", ["/health", "/v1/models", "/version", "/metrics"])
def test_head_on_get_routes(server, path):
    get = httpx.get(server.url + path, headers=server.headers, timeout=10)
    head = httpx.head(server.url + path, headers=server.headers, timeout=10)
    assert head.status_code == get.status_code == 200 and head.content == b""
    assert head.headers["content-type"] == get.headers["content-type"]


def test_x_request_id_is_echoed_or_given(server):
    r = _post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2}, headers={"X-Request-Id": "abc-123"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "abc-123"
    r = _post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2})
    assert len(r.headers["x-request-id"]) == 32
    with httpx.stream("POST", server.url + "/v1/completions", headers={**server.headers, "X-Request-Id": "s-1"},
                      json={"prompt": "x", "max_tokens": 2, "stream": True}, timeout=30) as r:
        assert r.headers["x-request-id"] == "s-1"
    assert httpx.get(server.url + "/nope", headers={"X-Request-Id": "e"}).headers["x-request-id"] == "e"


def test_tokenizer_info_serves_lm_evals_remote_tokenizer(server):
    info = httpx.get(server.url + "/tokenizer_info", headers=server.headers, timeout=10).json()
    assert info["eos_token"] and info["chat_template"] and info["model_max_length"] == 256
    eos = _post(server, "/tokenize", {"prompt": info["eos_token"], "add_special_tokens": False}).json()["tokens"]
    assert len(eos) == 1


def test_openai_defaults_sent_explicitly_are_accepted(server):
    r = _post(server, "/v1/chat/completions", {"messages": MSG, "max_tokens": 2, "store": False, "metadata": {},
                                               "service_tier": "auto", "parallel_tool_calls": True,
                                               "add_special_tokens": False})
    assert r.status_code == 200, r.text
    r = _post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2, "add_special_tokens": True})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"messages": MSG, "top_logprobs": 2}, "top_logprobs"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/chat/completions", {"messages": MSG, "store": True}, "store"),
    ("/v1/chat/completions", {"messages": MSG, "chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ("/v1/chat/completions", {"messages": MSG, "continue_final_message": True}, "continue_final_message"),
])
def test_what_would_be_ignored_is_a_400(server, path, body, param):
    r = _post(server, path, {"max_tokens": 2, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_chat_template_controls(server):
    template = "{% for m in messages %}[{{ m.role }}|{{ m.content }}]{% endfor %}{% if shout %}!{% endif %}"
    tok = _post(server, "/tokenize", {"prompt": "[user|Hi]!", "add_special_tokens": False}).json()["tokens"]
    r = _post(server, "/v1/chat/completions", {"messages": MSG, "max_tokens": 1, "chat_template": template,
                                               "chat_template_kwargs": {"shout": True}})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(tok), r.text
    cont = _post(server, "/v1/chat/completions", {
        "messages": MSG + [{"role": "assistant", "content": "Once upon"}], "max_tokens": 1,
        "add_generation_prompt": False, "continue_final_message": True})
    assert cont.status_code == 200, cont.text


def test_cors_headers_for_allowed_origins():
    s = Server("--allowed-origins", "https://app.example").wait_ready()
    try:
        pre = httpx.options(s.url + "/v1/chat/completions", headers={
            "Origin": "https://app.example", "Access-Control-Request-Method": "POST"}, timeout=10)
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "https://app.example"
        other = httpx.get(s.url + "/health", headers={"Origin": "https://evil.example"}, timeout=10)
        assert "access-control-allow-origin" not in other.headers
    finally:
        s.stop()
