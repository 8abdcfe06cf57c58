"""The OpenAI Batch API against `expresslane serve`, through the official client."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import time

import httpx
import pytest
from openai import OpenAI

from expresslane import SamplingParams

from .conftest import API_KEY, Server, metric


def wait_batch(client: OpenAI, batch_id: str, until=lambda b: b.status in ("completed", "failed", "expired",
                                                                           "cancelled"), timeout: float = 300,
               poll: float = 0.2):
    deadline = time.monotonic() + timeout
    while True:
        b = client.batches.retrieve(batch_id)
        if until(b):
            return b
        if time.monotonic() > deadline:
            raise TimeoutError(f"batch {batch_id} is still {b.status}: {b.request_counts}")
        time.sleep(poll)


def requests_file(n: int, url: str = "/v1/completions", max_tokens: int = 4) -> bytes:
    rows = []
    for i in range(n):
        body = ({"model": "tiny", "prompt": f"Request number {i}", "max_tokens": max_tokens, "temperature": 0.0,
                 "ignore_eos": True} if url == "/v1/completions" else
                {"model": "tiny", "messages": [{"role": "user", "content": f"Hello {i}"}], "max_tokens": max_tokens,
                 "temperature": 0.0, "ignore_eos": True})
        rows.append({"custom_id": f"req-{i}", "method": "POST", "url": url, "body": body})
    return b"".join(json.dumps(r).encode() + b"\n" for r in rows)


@pytest.fixture(scope="module")
def batch_server(tmp_path_factory):
    store = tmp_path_factory.mktemp("batch") / "store.db"
    s = Server("--batch-store", f"sqlite:{store}", "--batch-lease-seconds", "2", "--scheduling-policy", "deadline")
    try:
        yield s.wait_ready()
    finally:
        s.stop()


@pytest.fixture(scope="module")
def client(batch_server):
    return OpenAI(base_url=batch_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def test_an_embeddings_batch_is_refused_by_a_generation_server(client):
    from openai import BadRequestError

    f = client.files.create(file=("e.jsonl", io.BytesIO(json.dumps(
        {"custom_id": "e", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}}).encode())),
        purpose="batch")
    with pytest.raises(BadRequestError) as e:
        client.batches.create(input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h")
    assert e.value.body["param"] == "endpoint" and "--runner pooling" in e.value.body["message"]


def test_files_batches_round_trip_with_the_openai_client(client, batch_server, llm):
    content = requests_file(6) + b"\n"  # a trailing blank line is fine
    f = client.files.create(file=("requests.jsonl", io.BytesIO(content)), purpose="batch")
    assert (f.object, f.purpose, f.bytes, f.filename) == ("file", "batch", len(content), "requests.jsonl")
    assert client.files.retrieve(f.id).id == f.id
    assert client.files.content(f.id).content == content
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h",
                              metadata={"job": "nightly"})
    assert (b.object, b.status, b.request_counts.total, b.metadata) == ("batch", "in_progress", 6, {"job": "nightly"})
    done = wait_batch(client, b.id)
    assert done.status == "completed" and done.completed_at and done.output_file_id and done.error_file_id is None
    assert (done.request_counts.completed, done.request_counts.failed) == (6, 0)
    lines = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
    assert [x["custom_id"] for x in lines] == [f"req-{i}" for i in range(6)]
    refs = llm.generate([f"Request number {i}" for i in range(6)],
                        SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    for line, ref in zip(lines, refs):
        assert line["error"] is None and line["response"]["status_code"] == 200
        body = line["response"]["body"]
        assert body["object"] == "text_completion" and body["choices"][0]["text"] == ref.outputs[0].text
        assert body["usage"]["completion_tokens"] == 4
    assert done.usage.output_tokens == 24
    assert b.id in [x.id for x in client.batches.list(limit=100)]
    m = batch_server.metrics()
    assert metric(m, "expresslane:batch_requests_total", outcome="completed") >= 6
    # they ran in the batch lane
    assert metric(m, "expresslane:request_success_total", lane="batch") >= 6


def test_failed_requests_go_to_the_error_file(client):
    rows = [{"custom_id": "good", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}},
            {"custom_id": "bad-model", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": "nope", "messages": [{"role": "user", "content": "hi"}]}},
            {"custom_id": "bad-field", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}},
            {"custom_id": "streamed", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True}}]
    content = b"".join(json.dumps(r).encode() + b"\n" for r in rows)
    f = client.files.create(file=("mixed.jsonl", io.BytesIO(content)), purpose="batch")
    done = wait_batch(client, client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                                    completion_window="24h").id)
    assert (done.status, done.request_counts.completed, done.request_counts.failed) == ("completed", 1, 3)
    out = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
    err = {x["custom_id"]: x for x in map(json.loads, client.files.content(done.error_file_id).text.splitlines())}
    assert [x["custom_id"] for x in out] == ["good"] and out[0]["response"]["body"]["object"] == "chat.completion"
    assert err["bad-model"]["response"]["status_code"] == 404
    assert err["bad-field"]["response"]["status_code"] == 400
    assert err["bad-field"]["response"]["body"]["error"]["param"] == "max_tokens"
    assert err["streamed"]["response"]["body"]["error"]["param"] == "stream"


def test_invalid_files_and_ids_are_refused(client, batch_server):
    line = b'{"custom_id": "a", "url": "/v1/completions", "body": {}}\n'
    bad = line + line + b"not json\n"
    f = client.files.create(file=("bad.jsonl", io.BytesIO(bad)), purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    assert b.status == "failed" and [(e.line, e.code) for e in b.errors.data] == [
        (2, "duplicate_custom_id"), (3, "invalid_json_line")]
    h = {"Authorization": f"Bearer {API_KEY}"}
    cases = [
        ("post", "/v1/batches", {"json": {"input_file_id": "file-nope", "endpoint": "/v1/completions",
                                          "completion_window": "24h"}}, 404, "input_file_id"),
        ("post", "/v1/batches", {"json": {"input_file_id": f.id, "endpoint": "/v1/embeddings",
                                          "completion_window": "24h"}}, 400, "endpoint"),
        ("post", "/v1/batches", {"json": {"input_file_id": f.id, "endpoint": "/v1/completions"}}, 400,
         "completion_window"),
        ("get", "/v1/batches/batch_nope", {}, 404, "batch_id"),
        ("post", "/v1/batches/batch_nope/cancel", {}, 404, "batch_id"),
        ("get", "/v1/files/file-nope/content", {}, 404, "file_id"),
        ("get", "/v1/batches?limit=0", {}, 400, "limit"),
        ("post", "/v1/files", {"files": {"file": ("x.jsonl", b"{}")}, "data": {"purpose": "fine-tune"}}, 400,
         "purpose"),
        ("post", "/v1/files", {"data": {"purpose": "batch"}}, 400, "file"),
    ]
    for method, path, kwargs, status, param in cases:
        r = getattr(httpx, method)(batch_server.url + path, headers=h, timeout=30, **kwargs)
        assert (r.status_code, r.json()["error"]["param"]) == (status, param), (path, r.text)
    assert httpx.get(batch_server.url + "/v1/batches", timeout=30).status_code == 401  # the API key is required


def test_cancel_keeps_partial_results(client):
    f = client.files.create(file=("many.jsonl", io.BytesIO(requests_file(300, max_tokens=16))), purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    c = client.batches.cancel(b.id)
    assert c.status in ("cancelling", "completed") and (c.status == "completed" or c.cancelling_at)
    done = wait_batch(client, b.id, timeout=200)
    if done.status == "cancelled":  # the worker was faster than us only if all 300 finished first
        assert done.request_counts.completed < 300 and done.cancelled_at
        got = client.files.content(done.output_file_id).text.splitlines() if done.output_file_id else []
        assert len(got) == done.request_counts.completed
    else:
        assert done.status == "completed"


def test_a_store_that_cannot_be_opened_stops_serve_naming_it():
    r = subprocess.run([sys.executable, "-m", "expresslane.cli.main", "serve", "--port", "0",
                        "--batch-store", "redis://127.0.0.1:1/0"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--batch-store 'redis://127.0.0.1:1/0' cannot be opened" in r.stderr
