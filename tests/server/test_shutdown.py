"""SIGTERM: in-flight requests finish, new ones are refused, /health says 503, the process exits 0."""

from __future__ import annotations

import asyncio
import json
import signal

import httpx

from .conftest import Server

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
