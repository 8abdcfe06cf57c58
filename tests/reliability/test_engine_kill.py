"""SIGKILL the engine process: the requests in flight fail cleanly, the old engine is reaped, a new
one starts (`/health` says "restarting" meanwhile) and serves again; once `--engine-restarts`
are used up the server exits non-zero, so a supervisor notices."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from .conftest import Server, serves_a_normal_request, sse_events

pytestmark = pytest.mark.reliability

LONG = {"max_tokens": 2000, "ignore_eos": True}


def _reaped(pid: int) -> bool:
    """The process is gone, not a zombie that nobody waited for."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return True


def _wait_health(s: Server, timeout: float) -> list[str]:
    """Poll /health until it says ok; returns the distinct states it went through."""
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while True:
        status = httpx.get(s.url + "/health", timeout=10).json()["status"]
        if not seen or seen[-1] != status:
            seen.append(status)
        if status == "ok":
            return seen
        assert time.monotonic() < deadline, f"no service {timeout:.0f} s after the kill: /health went {seen}"
        time.sleep(0.05)


async def _kill_with_requests_in_flight(s: Server) -> tuple[list, httpx.Response]:
    async def stream(http: httpx.AsyncClient, started: asyncio.Event) -> list:
        async with http.stream("POST", "/v1/completions", json={"prompt": "doomed", "stream": True, **LONG}) as r:
            lines = []
            async for line in r.aiter_lines():
                lines.append(line)
                started.set()
            return sse_events(lines)

    async with httpx.AsyncClient(base_url=s.url, headers=s.headers, timeout=60) as http:
        started = [asyncio.Event() for _ in range(3)]
        streams = [asyncio.create_task(stream(http, e)) for e in started]
        plain = asyncio.create_task(http.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "doomed"}], **LONG}))
        await asyncio.gather(*(e.wait() for e in started))
        os.kill(s.engine_pid(), signal.SIGKILL)
        return await asyncio.gather(*streams), await plain


def test_engine_kill_restarts_the_engine_and_serves_again():
    t0 = time.monotonic()
    s = Server("--engine-restarts", "1", "--max-model-len", "2048").wait_ready()
    startup = time.monotonic() - t0  # imports, the engine process and the model load: the bound below
    try:
        old = s.engine_pid()
        t_kill = time.monotonic()
        streams, plain = asyncio.run(_kill_with_requests_in_flight(s))
        for events in streams:  # failed cleanly: an error event then [DONE], nothing cut
            assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "engine_dead", events[-2:]
        assert plain.status_code == 500 and plain.json()["error"]["code"] == "engine_dead", plain.text
        # A restart spawns a process and loads the model again, as at startup; twice the measured
        # startup plus the first backoff (0.5 s) and 10 s of slack is a hang guard, not a benchmark.
        seen = _wait_health(s, timeout=2 * startup + 10.5)
        restart_took = time.monotonic() - t_kill
        assert "restarting" in seen, seen
        assert _reaped(old), f"the killed engine {old} was left a zombie"
        assert s.engine_pid() != old
        serves_a_normal_request(s)
        print(f"\nstartup {startup:.1f} s; engine SIGKILL -> /health ok {restart_took:.1f} s (went {seen})")

        os.kill(s.engine_pid(), signal.SIGKILL)  # the one restart is used up: the server must exit non-zero
        assert s.proc.wait(timeout=30) != 0
    finally:
        s.stop()
