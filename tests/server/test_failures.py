"""Requests that cannot finish: the server-side deadline, and a dead engine process. No hangs."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import pytest

from .conftest import Server, metric
from .test_concurrency import wait_idle

LONG = {"max_tokens": 2000, "ignore_eos": True}  # far longer than the 1 s deadline


@pytest.fixture(scope="module")
def failing_server():
    s = Server("--request-timeout", "1", "--max-model-len", "2048")
    try:
        yield s.wait_ready()
    finally:
        s.stop()


def sse_events(r: httpx.Response) -> list:
    return [line[6:] if line == "data: [DONE]" else json.loads(line[6:])
            for line in r.iter_lines() if line.startswith("data: ")]


def test_request_timeout_aborts_and_frees(failing_server):
    s = failing_server
    aborts = metric(s.metrics(), "expresslane:request_success_total", finished_reason="abort")
    timeouts = metric(s.metrics(), "expresslane:request_errors_total", status="504", reason="request_timeout")
    t0 = time.monotonic()
    r = httpx.post(s.url + "/v1/completions", json={"prompt": "slow", **LONG}, headers=s.headers, timeout=30)
    assert r.status_code == 504 and r.json()["error"]["code"] == "request_timeout"
    assert time.monotonic() - t0 < 5
    with httpx.stream("POST", s.url + "/v1/completions", json={"prompt": "slow", "stream": True, **LONG},
                      headers=s.headers, timeout=30) as r:
        assert r.status_code == 200
        events = sse_events(r)
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "request_timeout"
    assert any(e.get("choices") for e in events[:-2])  # tokens came before the deadline
    wait_idle(s, 2.0)
    assert metric(s.metrics(), "expresslane:request_success_total", finished_reason="abort") == aborts + 2
    # both counted as errors: the JSON 504 and the error event that ended the stream
    assert metric(s.metrics(), "expresslane:request_errors_total", status="504", reason="request_timeout") == \
        timeouts + 2


def test_engine_death_fails_in_flight_requests_and_health(failing_server):
    s = failing_server

    async def stream(http: httpx.AsyncClient, started: asyncio.Event) -> list:
        async with http.stream("POST", "/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], "stream": True, **LONG}) as r:
            events = []
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
                    started.set()
            return events

    async def main():
        async with httpx.AsyncClient(base_url=s.url, headers=s.headers, timeout=30) as http:
            started = [asyncio.Event() for _ in range(3)]
            streams = [asyncio.create_task(stream(http, e)) for e in started]
            plain = asyncio.create_task(http.post("/v1/completions", json={"prompt": "x", **LONG}))
            await asyncio.gather(*(e.wait() for e in started))
            os.kill(s.engine_pid(), signal.SIGKILL)
            t0 = time.monotonic()
            done, pending = await asyncio.wait([*streams, plain], timeout=5)
            assert not pending, "in-flight requests must fail within 5 s"
            return [t.result() for t in streams], plain.result(), time.monotonic() - t0

    streams, plain, took = asyncio.run(main())
    assert took < 5
    for events in streams:
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "engine_dead"
    assert plain.status_code == 500 and plain.json()["error"]["code"] == "engine_dead"
    health = httpx.get(s.url + "/health")
    assert health.status_code == 503 and health.json()["status"] == "dead"
    r = httpx.post(s.url + "/v1/completions", json={"prompt": "x"}, headers=s.headers)
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
