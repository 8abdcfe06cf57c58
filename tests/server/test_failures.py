"""Requests that cannot finish: the server-side deadline, and a dead engine process (failed at once,
then a new engine). No hangs."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

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
    r = httpx.post(s.url + "/v1/completions", json={"prompt": "slow", **LONG}, headers=s.headers, timeout=30)
    assert r.status_code == 504 and r.json()["error"]["code"] == "request_timeout"
    with httpx.stream("POST", s.url + "/v1/completions", json={"prompt": "slow", "stream": True, **LONG},
                      headers=s.headers, timeout=30) as r:
        assert r.status_code == 200
        events = sse_events(r)
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "request_timeout"
    assert any(e.get("choices") for e in events[:-2])  # tokens came before the deadline
    wait_idle(s, 30)  # "eventually": a hang guard, not a figure
    assert metric(s.metrics(), "expresslane:request_success_total", finished_reason="abort") == aborts + 2
    # both counted as errors: the JSON 504 and the error event that ended the stream
    assert metric(s.metrics(), "expresslane:request_errors_total", status="504", reason="request_timeout") == \
        timeouts + 2


async def _in_flight_then_kill(s: Server) -> tuple[list, httpx.Response, list[str]]:
    """Three streams and one plain request in flight, then SIGKILL to the engine; their results
    and the /health statuses seen until the server serves again (or exits)."""

    async def stream(http: httpx.AsyncClient, started: asyncio.Event) -> list:
        async with http.stream("POST", "/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], "stream": True, **LONG}) as r:
            events = []
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
                    started.set()
            return events

    async with httpx.AsyncClient(base_url=s.url, headers=s.headers, timeout=60) as http:
        started = [asyncio.Event() for _ in range(3)]
        streams = [asyncio.create_task(stream(http, e)) for e in started]
        plain = asyncio.create_task(http.post("/v1/completions", json={"prompt": "x", **LONG}))
        await asyncio.gather(*(e.wait() for e in started))
        os.kill(s.engine_pid(), signal.SIGKILL)
        # Every request in flight fails; the 60 s client timeout only guards against a hang.
        results = await asyncio.gather(*streams, plain)
        seen = []
        deadline = time.monotonic() + 120  # "eventually": a generous bound on a new engine's load, not a figure
        while time.monotonic() < deadline and s.proc.poll() is None:
            try:
                status = (await http.get("/health")).json()["status"]
            except httpx.TransportError:  # the server is exiting
                break
            if not seen or seen[-1] != status:
                seen.append(status)
            if status == "ok" and len(seen) > 1:
                break
            await asyncio.sleep(0.02)
        return results[:3], results[3], seen


def assert_failed_cleanly(streams: list, plain: httpx.Response) -> None:
    for events in streams:
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "engine_dead"
    assert plain.status_code == 500 and plain.json()["error"]["code"] == "engine_dead"


def reaped(pid: int) -> bool:
    """The process is gone, not a zombie (a zombie keeps its /proc entry in state Z)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "X"
    except (FileNotFoundError, ProcessLookupError):
        return True


def test_engine_death_fails_in_flight_requests_then_a_new_engine_serves_until_restarts_run_out():
    s = Server("--engine-restarts", "1", "--max-model-len", "2048").wait_ready()
    try:
        first = s.engine_pid()
        streams, plain, seen = asyncio.run(_in_flight_then_kill(s))
        assert_failed_cleanly(streams, plain)
        assert "restarting" in seen and seen[-1] == "ok", seen
        assert set(seen) <= {"ok", "restarting", "dead"}
        assert reaped(first)
        second = s.engine_pid()
        assert second != first
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "again", "max_tokens": 3}, headers=s.headers,
                       timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        # the second death uses up --engine-restarts 1: requests fail, then the server exits 1
        streams, plain, _ = asyncio.run(_in_flight_then_kill(s))
        assert_failed_cleanly(streams, plain)
        assert s.proc.wait(timeout=60) == 1
        log = Path(s.log.name).read_text()
        assert "no restarts are left (--engine-restarts 1): exiting" in log
        assert "Traceback" not in log
    finally:
        s.stop()
