"""SIGTERM with requests in flight: none is lost.

Within the shutdown timeout every admitted request (running or still queued) finishes in full;
past it, every open stream ends with an SSE error event and [DONE] and every plain request gets
an error body, never a cut connection.
"""

from __future__ import annotations

import asyncio
import signal
import time

import httpx
import pytest

from .conftest import Server, metric, sse_events

pytestmark = pytest.mark.reliability

REQUESTS = 12
SEQS = 4  # --max-num-seqs: two thirds of the requests are still queued at SIGTERM
TOKENS = 160  # 480 decode steps in all: none ends before SIGTERM, and the drain outlasts the checks after it
MSG = [{"role": "user", "content": "drain"}]


def _request(i: int, tokens: int) -> tuple[str, dict]:
    common = {"max_tokens": tokens, "ignore_eos": True, "stream": i % 3 != 0}
    if common["stream"] and i % 4 != 2:
        common["stream_options"] = {"include_usage": True}
    return [("/v1/completions", {**common, "prompt": f"drain {i}"}),
            ("/v1/chat/completions", {**common, "messages": MSG}),
            ("/generate", {**common, "prompt": f"drain {i}"}),
            ("/v1/completions", {**common, "prompt": f"drain {i}"})][i % 4]


async def _send(http: httpx.AsyncClient, path: str, body: dict) -> tuple[int, list | dict]:
    if not body["stream"]:
        r = await http.post(path, json=body)
        return r.status_code, r.json()
    async with http.stream("POST", path, json=body) as r:
        return r.status_code, sse_events([line async for line in r.aiter_lines()])


def _tokens(path: str, result) -> int:
    """Completion tokens of a finished response or stream (0 if it ended in an error)."""
    if isinstance(result, dict):
        return len(result["token_ids"]) if path == "/generate" else result["usage"]["completion_tokens"]
    assert result and result[-1] == "[DONE]", result[-3:]
    if any("error" in e for e in result[:-1]):
        return 0
    if path == "/generate":
        return sum(len(e["token_ids"]) for e in result[:-1])
    if "usage" in result[-2] and result[-2]["usage"]:
        return result[-2]["usage"]["completion_tokens"]
    return -1  # a stream without usage: counted by its finish reason instead


async def _in_flight(server: Server, tokens: int) -> tuple[list, list]:
    """Send REQUESTS requests, SIGTERM once all are admitted, check the server refuses new ones."""
    async with httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=120,
                                 limits=httpx.Limits(max_connections=None)) as http:
        reqs = [_request(i, tokens) for i in range(REQUESTS)]
        tasks = [asyncio.create_task(_send(http, p, b)) for p, b in reqs]
        while True:  # every request admitted: running or waiting in the engine
            m = await asyncio.to_thread(server.metrics)  # off this loop: the streams keep reading
            in_engine = metric(m, "expresslane:num_requests_running") + metric(m, "expresslane:num_requests_waiting")
            if in_engine == REQUESTS:
                break
            ended = [(reqs[i][0], t.result()[0] if not t.exception() else repr(t.exception()))
                     for i, t in enumerate(tasks) if t.done()]
            assert not ended, f"requests ended before SIGTERM was sent: {ended}"
            await asyncio.sleep(0.01)
        server.proc.send_signal(signal.SIGTERM)
        server.sigterm_at = time.monotonic()
        while (await http.get("/health")).status_code == 200:
            await asyncio.sleep(0.01)
        refused = await http.post("/v1/completions", json={"prompt": "too late", "max_tokens": 2})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
        return reqs, await asyncio.gather(*tasks)


def test_sigterm_drains_every_request_in_flight():
    server = Server("--shutdown-timeout", "120", "--max-num-seqs", str(SEQS), "--max-model-len", "2048").wait_ready()
    try:
        reqs, results = asyncio.run(_in_flight(server, tokens=TOKENS))
        assert [status for status, _ in results] == [200] * REQUESTS
        for (path, body), (_, result) in zip(reqs, results):
            tail = result if isinstance(result, dict) else result[-3:]
            assert _tokens(path, result) in (TOKENS, -1), (path, body, tail)
            if isinstance(result, list) and path != "/generate":
                assert {c["finish_reason"] for e in result[:-1] for c in e["choices"]} >= {"length"}
        done = time.monotonic() - server.sigterm_at
        assert server.proc.wait(timeout=60) == 0
        print(f"\nSIGTERM with {REQUESTS} requests in flight ({REQUESTS - SEQS} queued): all {REQUESTS} complete "
              f"{done:.1f} s later; exit 0 after {time.monotonic() - server.sigterm_at:.1f} s")
    finally:
        server.stop()


def test_past_the_shutdown_timeout_every_stream_gets_an_error_and_done():
    server = Server("--shutdown-timeout", "1", "--max-num-seqs", str(SEQS), "--max-model-len", "2048").wait_ready()
    try:
        try:
            reqs, results = asyncio.run(_in_flight(server, tokens=2000))
        except httpx.TransportError as e:  # a cut connection: a lost request
            pytest.fail(f"a request was cut: {e!r}")
        for (path, body), (status, result) in zip(reqs, results):
            if body["stream"]:
                assert status == 200 and result[-1] == "[DONE]" and "error" in result[-2], result[-3:]
            else:
                assert status == 503 and result["error"]["message"], result
        assert server.proc.wait(timeout=30) == 0
        print(f"\n--shutdown-timeout 1 with {REQUESTS} requests in flight: each ended with an error; exit 0 after "
              f"{time.monotonic() - server.sigterm_at:.1f} s")
    finally:
        server.stop()
