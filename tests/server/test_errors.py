"""Bad input gets the right status and an OpenAI error body naming the field; the server keeps serving."""

from __future__ import annotations

import httpx
import pytest

from .conftest import API_KEY, MAX_MODEL_LEN

C, CHAT, GEN = "/v1/completions", "/v1/chat/completions", "/generate"
OK_MSG = [{"role": "user", "content": "hi"}]
LONG = "word " * (MAX_MODEL_LEN + 10)

# (name, path, body (dict, or raw bytes), headers override, status, param, text expected in the message)
CASES = [
    ("malformed json", C, b'{"prompt": "x",', None, 400, None, "not valid JSON"),
    ("body not an object", C, b"[1, 2]", None, 400, None, "JSON object"),
    ("missing prompt", C, {"max_tokens": 3}, None, 400, "prompt", "required"),
    ("prompt wrong type", C, {"prompt": 5}, None, 400, "prompt", "expected one of"),
    ("max_tokens wrong type", C, {"prompt": "x", "max_tokens": "ten"}, None, 400, "max_tokens", "integer"),
    ("negative max_tokens", C, {"prompt": "x", "max_tokens": -1}, None, 400, "max_tokens", "greater than"),
    ("negative temperature", C, {"prompt": "x", "temperature": -0.5}, None, 400, "temperature", ""),
    ("top_p 0", C, {"prompt": "x", "top_p": 0}, None, 400, "top_p", "greater than 0"),
    ("n too large", C, {"prompt": "x", "n": 1000}, None, 400, "n", "less than or equal"),
    ("prompt over the context", C, {"prompt": LONG, "max_tokens": 1}, None, 400, "prompt",
     "maximum context length"),
    ("prompt + max_tokens over the context", C, {"prompt": "x", "max_tokens": MAX_MODEL_LEN}, None, 400,
     "max_tokens", "maximum context length"),
    ("token id outside the vocabulary", C, {"prompt": [1, 10**7]}, None, 400, "prompt", "prompt_token_ids"),
    ("stop wrong type", C, {"prompt": "x", "stop": 5}, None, 400, "stop", "expected one of"),
    ("stop_token_ids outside the vocabulary", C, {"prompt": "x", "stop_token_ids": [10**7]}, None, 400,
     "stop_token_ids", ""),
    ("min_tokens over max_tokens", C, {"prompt": "x", "max_tokens": 2, "min_tokens": 5}, None, 400, "min_tokens", ""),
    ("logprobs too many", C, {"prompt": "x", "logprobs": 50}, None, 400, "logprobs", ""),
    ("penalty out of range", C, {"prompt": "x", "presence_penalty": 2.5}, None, 400, "presence_penalty", "2"),
    ("bad lane", C, {"prompt": "x", "lane": "fast"}, None, 400, "lane", "interactive"),
    ("priority not an integer", C, {"prompt": "x", "priority": 1.5}, None, 400, "priority", "integer"),
    ("priority out of range", CHAT, {"messages": OK_MSG, "priority": 10**30}, None, 400, "priority", ""),
    ("best_of other than n", C, {"prompt": "x", "best_of": 3}, None, 400, "best_of", "not supported"),
    ("stream_options wrong type", C, {"prompt": "x", "stream": True, "stream_options": {"include_usage": "yes"}},
     None, 400, "stream_options.include_usage", "boolean"),
    ("unknown model", C, {"model": "gpt-9", "prompt": "x"}, None, 404, "model", "does not exist"),
    ("bad API key", C, {"prompt": "x"}, {"Authorization": "Bearer wrong"}, 401, None, "API key"),
    ("missing API key", C, {"prompt": "x"}, {}, 401, None, "API key"),
    ("empty messages", CHAT, {"messages": []}, None, 400, "messages", "at least 1"),
    ("unknown role", CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, None, 400, "messages[0].role", ""),
    ("content wrong type", CHAT, {"messages": [{"role": "user", "content": 7}]}, None, 400, "messages[0].content",
     ""),
    ("chat over the context", CHAT, {"messages": [{"role": "user", "content": LONG}]}, None, 400, "messages",
     "maximum context length"),
    ("tool without a function", CHAT, {"messages": OK_MSG, "tools": [{"type": "function"}]}, None, 400,
     "tools[0].function", "required"),
    ("streamed bad input fails before the header", CHAT, {"messages": OK_MSG, "stream": True, "top_p": 0}, None,
     400, "top_p", ""),
    ("generate n > 1", GEN, {"prompt": "x", "n": 2}, None, 400, "n", ""),
    ("generate empty prompt", GEN, {"prompt": ""}, None, 400, "prompt", ""),
    ("unknown field", C, {"prompt": "x", "temprature": 0.5}, None, 400, "temprature", "unknown field"),
    ("unknown field in a message", CHAT, {"messages": [{"role": "user", "content": "x", "tool_callid": "a"}]},
     None, 400, "messages[0].tool_callid", ""),
    ("vLLM field not implemented", C, {"prompt": "x", "use_beam_search": True}, None, 400, "use_beam_search",
     "not supported"),
    ("guided_json that is not a schema", CHAT, {"messages": OK_MSG, "guided_json": "[1, 2]"}, None, 400,
     "guided_json", "JSON schema"),
    ("reasoning_effort on a model that does not reason", CHAT, {"messages": OK_MSG, "reasoning_effort": "high"}, None,
     400, "reasoning_effort", "--reasoning-parser"),
    ("reasoning_effort not OpenAI's", CHAT, {"messages": OK_MSG, "reasoning_effort": "turbo"}, None, 400,
     "reasoning_effort", ""),
]


@pytest.mark.parametrize("name,path,body,headers,status,param,text", CASES, ids=[c[0] for c in CASES])
def test_bad_input(server, name, path, body, headers, status, param, text):
    h = {"Authorization": f"Bearer {API_KEY}"} if headers is None else headers
    kw = {"content": body, "headers": {**h, "Content-Type": "application/json"}} if isinstance(body, bytes) \
        else {"json": body, "headers": h}
    r = httpx.post(server.url + path, timeout=30, **kw)
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param and text in err["message"], err
    assert err["type"] == {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error"}[status]


def test_unknown_route_and_method(server):
    r = httpx.get(server.url + "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    assert httpx.get(server.url + C, headers=server.headers).status_code == 405


def test_server_keeps_serving_after_bad_input(server, openai_client):
    for _ in range(3):
        httpx.post(server.url + C, content=b"{nope", headers=server.headers)
    assert httpx.get(server.url + "/health").status_code == 200
    assert openai_client.completions.create(model="tiny", prompt="still here", max_tokens=2).choices[0].text


def test_vllm_fields_at_their_no_op_value_are_accepted(server):
    r = httpx.post(server.url + C, headers=server.headers, timeout=60,
                   json={"prompt": "x", "max_tokens": 2, "use_beam_search": False, "guided_json": None,
                         "spaces_between_special_tokens": True, "bad_words": [], "user": "someone"})
    assert r.status_code == 200, r.text
