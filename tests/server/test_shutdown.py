"""SIGTERM: in-flight requests finish (or, past --shutdown-timeout, end with an error), new ones are
refused, /health says 503, the process exits 0 and its engine is reaped."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path

import httpx

from .conftest import Server, metric

TOKENS = 300  # long enough to still be running while the test checks that new requests are refused


def test_sigterm_drains_in_flight_requests_and_exits_0():
    server = Server("--shutdown-timeout", "30", "--max-model-len", "2048").wait_ready()
    try:
        asyncio.run(_drain(server))
        assert server.proc.wait(timeout=30) == 0
    finally:
        server.stop()


async def _drain(server: Server) -> None:
    started = [asyncio.Event() for _ in range(3)]

    async def stream(http: httpx.AsyncClient, i: int) -> tuple[int, str | None, bool]:
        tokens, reason, done = 0, None, False
        async with http.stream("POST", "/generate", json={"prompt": f"drain {i}", "max_tokens": TOKENS,
                                                          "ignore_eos": True, "stream": True}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    event = json.loads(line[6:])
                    tokens += len(event["token_ids"])
                    reason = event["finish_reason"] or reason
                    started[i].set()
        return tokens, reason, done

    async with httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=60) as http:
        tasks = [asyncio.create_task(stream(http, i)) for i in range(3)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 30)
        server.proc.send_signal(signal.SIGTERM)
        while (health := await http.get("/health")).status_code == 200:  # noticed within 0.1 s
            await asyncio.sleep(0.02)
        assert health.status_code == 503 and health.json()["status"] == "draining"
        refused = await http.post("/v1/completions", json={"prompt": "too late", "max_tokens": 2})
        assert refused.status_code == 503 and "Retry-After" in refused.headers
        assert refused.json()["error"]["code"] == "shutting_down"
        assert all(not t.done() for t in tasks), "requests must still be in flight when the new one is refused"
        results = await asyncio.gather(*tasks)
    assert results == [(TOKENS, "length", True)] * 3


def test_past_the_shutdown_timeout_open_requests_end_with_an_error_and_done():
    """--shutdown-timeout 0: at SIGTERM every request in flight is past the timeout. Streams get
    an SSE error event and [DONE], a plain request a 503; one log line, no traceback; exit 0."""
    server = Server("--shutdown-timeout", "0", "--max-model-len", "2048").wait_ready()
    try:
        engine = server.engine_pid()
        streams, plain = asyncio.run(_cut(server))
        assert server.proc.wait(timeout=30) == 0
        for events in streams:
            assert events[-1] == "[DONE]", events[-3:]
            assert events[-2]["error"]["code"] == "shutting_down" and "--shutdown-timeout 0 s" in \
                events[-2]["error"]["message"]
            assert any(e.get("choices") for e in events[:-2])
        assert plain.status_code == 503 and plain.json()["error"]["code"] == "shutting_down"
        log = Path(server.log.name).read_text()
        assert log.count("shutdown timeout (0 s) reached: ended 4 requests still in flight with an error") == 1
        assert "Traceback" not in log and " ERROR " not in log
        assert not Path(f"/proc/{engine}").exists() or _reaped_later(engine)
    finally:
        server.stop()


def _reaped_later(pid: int) -> bool:
    # The engine is our child until the server exits; "eventually" gone: a generous poll, not a figure.
    deadline = time.monotonic() + 30
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return not Path(f"/proc/{pid}").exists()


async def _cut(server: Server) -> tuple[list[list], httpx.Response]:
    started = [asyncio.Event() for _ in range(3)]

    async def stream(http: httpx.AsyncClient, i: int) -> list:
        events = []
        async with http.stream("POST", "/v1/completions", json={"prompt": f"cut {i}", "max_tokens": 2000,
                                                                "ignore_eos": True, "stream": True}) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
                    started[i].set()
        return events

    async with httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=60) as http:
        tasks = [asyncio.create_task(stream(http, i)) for i in range(3)]
        plain = asyncio.create_task(http.post("/v1/completions", json={"prompt": "plain", "max_tokens": 2000,
                                                                       "ignore_eos": True}))
        await asyncio.gather(*(e.wait() for e in started))
        deadline = time.monotonic() + 30  # the plain request reached the engine too (a hang guard, not a figure)
        while metric(server.metrics(), "expresslane:num_requests_running") < 4:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        server.proc.send_signal(signal.SIGTERM)
        return await asyncio.gather(*tasks), await plain
