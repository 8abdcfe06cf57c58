"""A bad-input matrix over every route: each hostile request gets a 4xx (never a 5xx), with an
OpenAI error body where the route is ours, and the server keeps serving normal requests.

Cases are (id, method, path, body, headers, expected status). A body is a dict (sent as JSON),
bytes (sent as is) or None; headers=None means the right API key. Expected 200s are the
largest valid requests and vLLM's fields at their no-op value (docs/api.md).
"""

from __future__ import annotations

import socket

import httpx
import pytest

from expresslane.server.launch import MAX_HEADER_BYTES
from server.conftest import API_KEY

from .conftest import serves_a_normal_request

pytestmark = pytest.mark.reliability

C, CHAT, GEN, TOK, DETOK = "/v1/completions", "/v1/chat/completions", "/generate", "/tokenize", "/detokenize"
RESP = "/v1/responses"
POSTS = (C, CHAT, GEN, TOK, DETOK, RESP)
GETS = ("/health", "/version", "/metrics", "/load", "/v1/models", "/v1/models/tiny", "/openapi.json")
MSG = [{"role": "user", "content": "hi"}]
OK = {C: {"prompt": "x", "max_tokens": 2}, CHAT: {"messages": MSG, "max_tokens": 2},
      GEN: {"prompt": "x", "max_tokens": 2}, TOK: {"prompt": "x"}, DETOK: {"tokens": [1, 2]},
      RESP: {"input": "x", "max_output_tokens": 2}}
BIG = 10**30

CASES: list[tuple] = []


def case(name: str, method: str, path: str, body=None, headers=None, status: int = 400) -> None:
    CASES.append((name, method, path, body, headers, status))


# Malformed JSON, on every POST route.
for p in POSTS:
    for name, raw in [("truncated", b'{"prompt": "x",'), ("trailing comma", b'{"prompt": "x",}'), ("empty body", b""),
                      ("null", b"null"), ("array", b"[1, 2]"), ("string", b'"prompt"'),
                      ("invalid utf-8", b"{\xff\xfe}"), ("trailing garbage", b'{"prompt": "x"} zz'),
                      ("nested 100k deep", b"[" * 100_000 + b"]" * 100_000)]:
        case(f"{p} malformed: {name}", "POST", p, raw)
for p in (C, GEN):
    case(f"{p} malformed: NaN literal", "POST", p, b'{"prompt": "x", "temperature": NaN}')

# Wrong types.
for name, body in [("prompt object", {"prompt": {"a": 1}}), ("prompt bool", {"prompt": True}),
                   ("prompt float", {"prompt": 1.5}), ("prompt list of objects", {"prompt": [{"a": 1}]}),
                   ("prompt mixed list", {"prompt": ["a", 1]}),
                   ("max_tokens float", {"prompt": "x", "max_tokens": 1.5}),
                   ("max_tokens string", {"prompt": "x", "max_tokens": "16"}),
                   ("max_tokens bool", {"prompt": "x", "max_tokens": True}),
                   ("temperature string", {"prompt": "x", "temperature": "hot"}),
                   ("stream string", {"prompt": "x", "stream": "yes"}), ("n string", {"prompt": "x", "n": "2"}),
                   ("stop list of ints", {"prompt": "x", "stop": [1, 2]}),
                   ("stop_token_ids string", {"prompt": "x", "stop_token_ids": "7"}),
                   ("seed float", {"prompt": "x", "seed": 1.5}), ("top_k float", {"prompt": "x", "top_k": 2.5}),
                   ("logprobs bool", {"prompt": "x", "logprobs": True}),
                   ("priority string", {"prompt": "x", "priority": "high"}), ("model int", {"prompt": "x", "model": 3}),
                   ("user object", {"prompt": "x", "user": {"id": 1}}),
                   ("stream_options list", {"prompt": "x", "stream": True, "stream_options": []})]:
    case(f"completions type: {name}", "POST", C, body)
for name, body in [("messages string", {"messages": "hi"}), ("messages of strings", {"messages": ["hi"]}),
                   ("content object", {"messages": [{"role": "user", "content": {"text": "x"}}]}),
                   ("role missing", {"messages": [{"content": "x"}]}),
                   ("logprobs int", {"messages": MSG, "logprobs": 5}),
                   ("max_completion_tokens string", {"messages": MSG, "max_completion_tokens": "9"}),
                   ("tools not a list", {"messages": MSG, "tools": "none"})]:
    case(f"chat type: {name}", "POST", CHAT, body)
case("generate prompt list of lists", "POST", GEN, {"prompt": [[1, 2]]})
case("tokenize prompt int", "POST", TOK, {"prompt": 5})
case("tokenize both prompt and messages", "POST", TOK, {"prompt": "x", "messages": MSG})
case("tokenize neither", "POST", TOK, {})
case("detokenize tokens strings", "POST", DETOK, {"tokens": ["a"]})
case("detokenize tokens missing", "POST", DETOK, {})

# Huge and negative numbers.
for name, body in [("max_tokens huge", {"prompt": "x", "max_tokens": BIG}),
                   ("max_tokens 0", {"prompt": "x", "max_tokens": 0}),
                   ("max_tokens negative", {"prompt": "x", "max_tokens": -5}), ("n 0", {"prompt": "x", "n": 0}),
                   ("n negative", {"prompt": "x", "n": -1}), ("n huge", {"prompt": "x", "n": BIG}),
                   ("n 129", {"prompt": "x", "n": 129}), ("top_p 2", {"prompt": "x", "top_p": 2}),
                   ("top_p negative", {"prompt": "x", "top_p": -1}), ("top_k -2", {"prompt": "x", "top_k": -2}),
                   ("top_k huge", {"prompt": "x", "top_k": BIG}), ("min_p 1.5", {"prompt": "x", "min_p": 1.5}),
                   ("temperature negative", {"prompt": "x", "temperature": -1}),
                   ("seed over int64", {"prompt": "x", "seed": 2**64}),
                   ("seed under int64", {"prompt": "x", "seed": -(2**64)}),
                   ("min_tokens negative", {"prompt": "x", "min_tokens": -1}),
                   ("min_tokens huge", {"prompt": "x", "min_tokens": BIG}),
                   ("priority huge", {"prompt": "x", "priority": 2**40}),
                   ("logprobs negative", {"prompt": "x", "logprobs": -1}),
                   ("logprobs 21", {"prompt": "x", "logprobs": 21}),
                   ("logprobs huge", {"prompt": "x", "logprobs": 10**6}),
                   ("stop_token_ids negative", {"prompt": "x", "stop_token_ids": [-1]}),
                   ("stop_token_ids huge", {"prompt": "x", "stop_token_ids": [2**40]}),
                   ("token id negative", {"prompt": [-1]}), ("token id over int64", {"prompt": [2**63]})]:
    case(f"completions number: {name}", "POST", C, body)
case("completions temperature inf", "POST", C, b'{"prompt": "x", "temperature": 1e999}')
case("chat top_logprobs 21", "POST", CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 21})
case("chat max_completion_tokens negative", "POST", CHAT, {"messages": MSG, "max_completion_tokens": -1})
case("chat n huge", "POST", CHAT, {"messages": MSG, "n": BIG})
case("generate max_tokens huge", "POST", GEN, {"prompt": "x", "max_tokens": BIG})
case("generate token id negative", "POST", GEN, {"prompt": [-3]})
case("detokenize token negative", "POST", DETOK, {"tokens": [-1]})
case("detokenize token huge", "POST", DETOK, {"tokens": [10**12]})
case("detokenize token over int64", "POST", DETOK, {"tokens": [2**70]})

# Unknown fields: refused naming them (docs/api.md); vLLM's unimplemented ones only at their no-op value.
case("completions unknown field", "POST", C, {**OK[C], "frobnicate": 1})
case("completions unknown object field", "POST", C, {**OK[C], "__proto__": {"admin": True}})
case("chat unknown field in a message", "POST", CHAT, {"messages": [{"role": "user", "content": "hi", "x": 1}],
                                                        "max_tokens": 2})
case("generate vLLM field not implemented", "POST", GEN, {**OK[GEN], "logits_processors": ["x"]})
case("generate vLLM field at its no-op value", "POST", GEN, {**OK[GEN], "logits_processors": None}, status=200)
case("generate guided_json not a schema", "POST", GEN, {**OK[GEN], "guided_json": [1]})
case("tokenize unknown field", "POST", TOK, {**OK[TOK], "extra": [1]})

# The Responses API's items and tools, malformed.
for name, body in [("input object", {"input": {"a": 1}}), ("input item a number", {"input": [1]}),
                   ("input item without type or role", {"input": [{"content": "x"}]}),
                   ("content part null", {"input": [{"role": "user", "content": [None]}]}),
                   ("function_call arguments object", {"input": [{"type": "function_call", "call_id": "c",
                                                                  "name": "f", "arguments": {}}]}),
                   ("tools a number", {"tools": 5}), ("tools of strings", {"tools": ["x"]}),
                   ("tool without name", {"tools": [{"type": "function"}]}),
                   ("metadata 17 keys", {"metadata": {str(i): "v" for i in range(17)}}),
                   ("metadata value a number", {"metadata": {"a": 1}}),
                   ("store true", {"store": True}), ("text.format xml", {"text": {"format": {"type": "xml"}}})]:
    case(f"responses {name}", "POST", RESP, {**OK[RESP], **body})
case("GET a stored response", "GET", RESP + "/resp_1", status=404)

# Bad enums.
case("chat role wizard", "POST", CHAT, {"messages": [{"role": "wizard", "content": "x"}]})
case("chat content part image", "POST", CHAT, {"messages": [{"role": "user", "content": [
    {"type": "image_url", "image_url": {"url": "http://x"}}]}]})
case("chat response_format xml", "POST", CHAT, {"messages": MSG, "response_format": {"type": "xml"}})
case("completions lane fast", "POST", C, {**OK[C], "lane": "fast"})
case("generate lane number", "POST", GEN, {**OK[GEN], "lane": 1})

# Empty prompts.
case("completions empty list", "POST", C, {"prompt": []})
case("completions empty token list in a batch", "POST", C, {"prompt": [[1], []]})
case("generate empty string", "POST", GEN, {"prompt": ""})
case("generate empty token list", "POST", GEN, {"prompt": []})
case("chat empty messages", "POST", CHAT, {"messages": []})
case("chat empty content", "POST", CHAT, {"messages": [{"role": "user", "content": ""}], "max_tokens": 2}, status=200)
case("detokenize empty", "POST", DETOK, {"tokens": []}, status=200)

# The largest valid n and logprobs (one token each, so the case stays short).
case("n 128 with logprobs 20", "POST", C, {"prompt": "x", "n": 128, "logprobs": 20, "max_tokens": 1}, status=200)
case("chat n 128 top_logprobs 20", "POST", CHAT, {"messages": MSG, "n": 128, "logprobs": True, "top_logprobs": 20,
                                                  "max_tokens": 1}, status=200)

# Bad stop lists.
for name, stop, status in [("empty string", "", 400), ("list with empty string", ["a", ""], 400),
                           ("list with null", [None], 400), ("nested list", [["a"]], 400), ("object", {"a": 1}, 400),
                           ("empty list", [], 200), ("10k stop strings", [f"s{i}" for i in range(10_000)], 400),
                           ("one 100 kB stop string", "z" * 100_000, 200)]:
    case(f"completions stop: {name}", "POST", C, {**OK[C], "stop": stop}, status=status)
case("chat stop wrong type", "POST", CHAT, {"messages": MSG, "stop": 3})

# Bad headers and API keys, on every authenticated route.
for p in POSTS:
    case(f"{p} no API key", "POST", p, OK[p], {}, 401)
    case(f"{p} wrong API key", "POST", p, OK[p], {"Authorization": "Bearer wrong"}, 401)
case("/v1/models no API key", "GET", "/v1/models", None, {}, 401)
case("basic auth", "POST", C, OK[C], {"Authorization": "Basic dGVzdDp0ZXN0"}, 401)
case("bearer without a key", "POST", C, OK[C], {"Authorization": "Bearer"}, 401)
case("key with a suffix", "POST", C, OK[C], {"Authorization": f"Bearer {API_KEY}x"}, 401)
case("key not ASCII", "POST", C, OK[C], {"Authorization": b"Bearer \xff\xfe"}, 401)
case("64 kB API key", "POST", C, OK[C], {"Authorization": "Bearer " + "k" * 65_536}, 401)
case("form content type", "POST", C, b"prompt=x", {"Authorization": f"Bearer {API_KEY}",
                                                     "Content-Type": "application/x-www-form-urlencoded"})
case("gzip claimed, plain sent", "POST", C, b'{"prompt": "x"}'[::-1], {"Authorization": f"Bearer {API_KEY}",
                                                                     "Content-Encoding": "gzip"})

# The Batch API (files, batches) and the profiler routes.
FILES, BATCHES = "/v1/files", "/v1/batches"
case("files upload as JSON", "POST", FILES, {"purpose": "batch"})
case("files upload, no file field", "POST", FILES, None, {"Authorization": f"Bearer {API_KEY}"}, 400)
case("files upload, garbage multipart", "POST", FILES, b"--x\r\ngarbage",
     {"Authorization": f"Bearer {API_KEY}", "Content-Type": "multipart/form-data; boundary=x"})
case("files upload, no API key", "POST", FILES, {"purpose": "batch"}, {}, 401)
case("files list, negative limit", "GET", FILES + "?limit=-1")
case("files list, limit not a number", "GET", FILES + "?limit=ten")
case("files list, huge limit", "GET", FILES + f"?limit={BIG}")
case("file unknown", "GET", FILES + "/file-nope", status=404)
case("file content unknown", "GET", FILES + "/file-nope/content", status=404)
case("file delete unknown", "DELETE", FILES + "/file-nope", status=404)
case("file id 4 kB", "GET", FILES + "/" + "f" * 4096, status=404)
case("batch create, malformed", "POST", BATCHES, b'{"input_file_id": ')
case("batch create, missing file id", "POST", BATCHES, {"endpoint": C, "completion_window": "24h"})
case("batch create, unknown file", "POST", BATCHES, {"input_file_id": "file-nope", "endpoint": C,
                                                     "completion_window": "24h"}, status=404)
case("batch create, bad endpoint", "POST", BATCHES, {"input_file_id": "file-nope", "endpoint": "/v1/embeddings",
                                                     "completion_window": "24h"})
case("batch create, bad window", "POST", BATCHES, {"input_file_id": "file-nope", "endpoint": C,
                                                   "completion_window": "forever"})
case("batch create, metadata wrong type", "POST", BATCHES, {"input_file_id": "file-nope", "endpoint": C,
                                                            "completion_window": "24h", "metadata": [1]})
case("batches list, negative limit", "GET", BATCHES + "?limit=-5")
case("batches list, limit not a number", "GET", BATCHES + "?limit=%00")
case("batch unknown", "GET", BATCHES + "/batch_nope", status=404)
case("batch cancel unknown", "POST", BATCHES + "/batch_nope/cancel", status=404)
case("batches no API key", "GET", BATCHES, None, {}, 401)
case("stop_profile without --profile-dir", "POST", "/stop_profile", status=404)  # as vLLM: no profiler, no route
case("start_profile without --profile-dir", "POST", "/start_profile", status=404)
case("start_profile no API key", "POST", "/start_profile", None, {}, 401)

# Wrong methods and paths.
for p in POSTS:
    for method in ("GET", "PUT", "DELETE"):
        case(f"{method} {p}", method, p, None, None, 405)
for p in GETS:
    case(f"POST {p}", "POST", p, b"{}", None, 405)
for p in ["/", "/v1", "/v1/completion", "/v2/completions", "/v1/engines/tiny", "/v1/../etc/passwd",
          "/%00", "/" + "a" * 8000, "/v1/chat/completions/x"]:
    case(f"unknown path {p[:20]}", "POST", p, OK[C], None, 404)
case("embeddings from a generating server", "POST", "/v1/embeddings", b'{"model": "tiny", "input": "hi"}', None, 400)


@pytest.mark.parametrize("name,method,path,body,headers,status",
                         [pytest.param(*c, id=c[0]) for c in CASES])
def test_bad_request_gets_a_4xx_and_the_server_stays_up(server, name, method, path, body, headers, status):
    h = {"Authorization": f"Bearer {API_KEY}"} if headers is None else headers
    kw = {"content": body} if isinstance(body, bytes) else {"json": body} if body is not None else {}
    r = httpx.request(method, server.url + path, headers=h, timeout=60, **kw)
    assert r.status_code == status, r.text[:500]
    if status != 200:
        err = r.json()["error"]
        assert err["message"] and err["type"].endswith("_error"), err
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


# Broken HTTP, below the framework: the HTTP server answers 4xx or closes; it never crashes.
RAW = {
    "garbage request line": b"HELLO\r\n\r\n",
    "HTTP/0.9": b"GET /health\r\n\r\n",
    "header without a colon": b"GET /health HTTP/1.1\r\nHost: x\r\nnocolon\r\n\r\n",
    "negative Content-Length": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n",
    "two Content-Lengths":
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
    "bad chunked encoding": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    "NUL in a header": b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: a\x00b\r\n\r\n",
    "100 kB request line": b"GET /" + b"a" * 100_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
    "request line over the header limit": b"GET /" + b"a" * 2 * MAX_HEADER_BYTES + b" HTTP/1.1\r\nHost: x\r\n\r\n",
    "body shorter than Content-Length": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{",
}


def _raw(server, data: bytes) -> bytes:
    """The server's reply; empty when it closed. A server that answers 400 before reading all of
    an over-limit request closes with bytes unread, which TCP turns into a reset: a close too."""
    chunks = []
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)  # the client is done: the server must answer or close, not wait
            while chunk := sock.recv(65536):
                chunks.append(chunk)
    except TimeoutError:
        raise  # neither an answer nor a close
    except OSError:  # reset, broken pipe, not connected: all a close
        pass
    return b"".join(chunks)


@pytest.mark.parametrize("name", list(RAW))
def test_broken_http_gets_a_4xx_or_a_close(server, name):
    reply = _raw(server, RAW[name])
    if reply:
        status = int(reply.split(b" ", 2)[1])
        assert 400 <= status < 500, reply[:300]
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_still_serving_after_the_matrix(server):
    serves_a_normal_request(server)
