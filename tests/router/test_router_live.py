"""`expresslane router` (a real process) in front of fake replicas (real uvicorn processes):
lane-aware routing, prefix affinity over HTTP, a replica killed mid-run, router metrics."""

from __future__ import annotations

import time

import httpx
import pytest

from .conftest import fake_replica, router


@pytest.fixture
def procs():
    started = []

    def start(p):
        started.append(p)
        return p.wait_ready()

    yield start
    for p in started:
        p.stop()


def complete(url: str, prompt: str, **extra) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 4, **extra},
                      timeout=30)


def test_short_request_avoids_the_replica_in_a_long_prefill(procs):
    busy, idle = procs(fake_replica("busy", waiting=20_000)), procs(fake_replica("idle"))
    r = procs(router([busy.url, idle.url]))
    for i in range(4):
        assert complete(r.url, f"short {i}").json()["choices"][0]["text"] == "idle"
    # the idle one now reports a longer queue than the busy one: traffic follows
    httpx.post(idle.url + "/set_load", json={"waiting_tokens": {"interactive": 90_000}})
    httpx.post(busy.url + "/set_load", json={"waiting_tokens": {"interactive": 0}})
    # once the router has polled the new loads (its own metric says so), short work goes to "busy"
    deadline = time.monotonic() + 60  # a bound on the wait, not a timing claim
    while time.monotonic() < deadline:
        m = httpx.get(r.url + "/metrics").text
        if f'expresslane:router_replica_waiting_tokens{{lane="interactive",replica="{idle.url}"}} 90000.0' in m:
            break
    assert complete(r.url, "short again").json()["choices"][0]["text"] == "busy"


def test_prefix_affinity_over_http(procs):
    a, b = procs(fake_replica("a")), procs(fake_replica("b"))
    r = procs(router([a.url, b.url]))
    conversation = "user: tell me about the sea. " * 10
    first = complete(r.url, conversation).json()["choices"][0]["text"]
    for turn in range(4):
        conversation += f"assistant: reply {turn}. user: go on please, tell me more. "
        assert complete(r.url, conversation).json()["choices"][0]["text"] == first


def test_replica_killed_mid_run_is_removed_and_the_rest_keep_serving(procs):
    a, b, c = procs(fake_replica("a")), procs(fake_replica("b")), procs(fake_replica("c"))
    r = procs(router([a.url, b.url, c.url]))
    answered = {complete(r.url, f"warm-up prompt number {i} " * 4).json()["choices"][0]["text"] for i in range(9)}
    assert answered == {"a", "b", "c"}, "idle replicas with distinct prompts should all get work"
    a.kill()
    texts = []
    for i in range(12):  # a request sent to the dead replica is retried on another: none fails
        resp = complete(r.url, f"after the kill {i} " * 4, stream=(i % 2 == 0))
        assert resp.status_code == 200, resp.text
        texts.append(resp.text)
    assert not any('"a"' in t or "data: {\"choices\": [{\"index\": 0, \"text\": \"a\"" in t for t in texts)
    health = httpx.get(r.url + "/health").json()
    assert health["replicas"][a.url] == "down" and health["status"] == "ok"
    m = httpx.get(r.url + "/metrics").text
    assert f'expresslane:router_replica_up{{replica="{a.url}"}} 0.0' in m
    assert f'expresslane:router_replica_up{{replica="{b.url}"}} 1.0' in m
    # every replica down: a clean 503, not a hang
    b.kill()
    c.kill()
    resp = complete(r.url, "nobody home")
    assert resp.status_code == 503 and resp.json()["error"]["code"] == "no_replica_available"
    assert httpx.get(r.url + "/health").status_code == 503


def test_router_refuses_bad_input_and_passes_pooling_routes_on(procs):
    """A body that is not JSON is the router's 400; a pooling server's routes (embeddings, vLLM's
    /pooling, /score, /rerank) pass through it, token-id inputs counted as tokens for the routing."""
    from expresslane.router.app import POOLING_ROUTES

    a = procs(fake_replica("a"))
    r = procs(router([a.url]))
    resp = httpx.post(r.url + "/v1/completions", content=b"not json", timeout=10)
    assert resp.status_code == 400 and "JSON" in resp.json()["error"]["message"]
    bodies = {"/score": {"text_1": "q", "text_2": ["d"]}, "/rerank": {"query": "q", "documents": ["d"]}}
    for path in POOLING_ROUTES:
        body = bodies.get(path.removeprefix("/v1").removeprefix("/v2"), {"input": [[1, 2, 3], [4, 5]]})
        resp = httpx.post(r.url + path, json={"model": "m", **body}, timeout=30)
        assert resp.status_code == 200 and resp.json()["path"] == path and resp.json()["model"] == "a", resp.text
    assert len(httpx.get(a.url + "/seen", timeout=10).json()) == len(POOLING_ROUTES)


def test_a_draining_replica_gets_no_new_work(procs):
    a, b = procs(fake_replica("a")), procs(fake_replica("b"))
    r = procs(router([a.url, b.url]))
    httpx.post(a.url + "/set_load", json={"state": "draining"})
    deadline = time.monotonic() + 60  # a bound on the wait for the next poll, not a timing claim
    while time.monotonic() < deadline:
        if httpx.get(r.url + "/health").json()["replicas"][a.url] == "draining":
            break
    texts = {complete(r.url, f"while a drains {i} " * 4).json()["choices"][0]["text"] for i in range(6)}
    assert texts == {"b"}
    m = httpx.get(r.url + "/metrics").text
    assert f'expresslane:router_replica_up{{replica="{a.url}"}} 0.0' in m
