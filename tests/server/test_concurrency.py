"""Many streams at once: each gets its own output; dropped clients free their slots and KV."""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

import httpx
from openai import AsyncOpenAI

from expresslane import SamplingParams

from .conftest import metric


def test_50_concurrent_streams_each_get_their_own_output(server, llm):
    prompts = [f"Request number {i} says {'hello ' * (i % 5)}" for i in range(50)]
    refs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), use_tqdm=False)
    client = AsyncOpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0, timeout=120)

    async def one(prompt: str) -> tuple[str, str | None]:
        text, reason = "", None
        stream = await client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0.0,
                                                 stream=True, extra_body={"ignore_eos": True})
        async for chunk in stream:
            text += chunk.choices[0].text
            reason = chunk.choices[0].finish_reason or reason
        return text, reason

    async def main():
        try:
            return await asyncio.gather(*(one(p) for p in prompts))
        finally:
            await client.close()

    results = asyncio.run(main())
    assert [r[0] for r in results] == [ref.outputs[0].text for ref in refs]
    assert all(r[1] == "length" for r in results)


def wait_idle(server, timeout: float) -> tuple[float, dict]:
    """Seconds until /metrics shows no running or waiting request and an empty KV cache
    (``timeout`` only guards against a hang: callers pass a generous one)."""
    t0 = time.monotonic()
    while True:
        m = server.metrics()
        if (metric(m, "expresslane:num_requests_running") == 0 and metric(m, "expresslane:num_requests_waiting") == 0
                and metric(m, "expresslane:kv_cache_usage_perc") == 0.0):
            return time.monotonic() - t0, m
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"not idle after {timeout}s: running "
                                 f"{metric(m, 'expresslane:num_requests_running')}, "
                                 f"KV {metric(m, 'expresslane:kv_cache_usage_perc')}")
        time.sleep(0.05)


def test_dropped_streams_and_requests_are_aborted_and_freed(server):
    """20 streams dropped part-way, plus non-streamed requests dropped while queued or running."""
    wait_idle(server, 30)
    m = server.metrics()
    aborts_before = metric(m, "expresslane:request_success_total", finished_reason="abort")
    finished_before = metric(m, "expresslane:request_success_total", finished_reason="length")
    body = {"model": "tiny", "max_tokens": 200, "ignore_eos": True, "stream": True}

    async def drop_stream(http: httpx.AsyncClient, i: int) -> int:
        async with http.stream("POST", "/v1/completions", json={**body, "prompt": f"Stream {i} " * 8}) as r:
            assert r.status_code == 200
            n = 0
            async for line in r.aiter_lines():
                n += line.startswith("data: ")
                if n >= 3:  # decoding now: leave without reading the rest
                    return n
        raise AssertionError("the stream ended before it was dropped")

    async def drop_plain(http: httpx.AsyncClient) -> None:
        """Four plain requests, dropped (task cancelled: the connection closes) once the engine has them."""
        before = engine_requests(server)
        tasks = [asyncio.create_task(http.post("/v1/completions", json={**body, "stream": False, "max_tokens": 240,
                                                                          "prompt": f"Plain {i}"}))
                 for i in range(4)]
        deadline = time.monotonic() + 60  # a hang guard, not a figure
        while engine_requests(server) < before + 4 and not any(t.done() for t in tasks):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def main():
        async with httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=60) as http:
            await drop_plain(http)
            await asyncio.gather(*(drop_stream(http, i) for i in range(20)))

    asyncio.run(main())
    _, m = wait_idle(server, 30)  # "eventually" idle: a generous bound, not a latency figure
    aborts = metric(m, "expresslane:request_success_total", finished_reason="abort") - aborts_before
    finished = metric(m, "expresslane:request_success_total", finished_reason="length") - finished_before
    # Each dropped request was aborted, unless it had finished while the client was leaving (a plain
    # request's 240 tokens can beat the drop on a fast machine); the streams left 197 tokens early.
    assert aborts + finished == 24 and aborts >= 20, (aborts, finished)


def engine_requests(server) -> float:
    m = server.metrics()
    return metric(m, "expresslane:num_requests_running") + metric(m, "expresslane:num_requests_waiting")


def test_a_client_that_leaves_is_an_info_line_mid_upload_and_mid_stream(server):
    log = Path(server.log.name)
    start = log.stat().st_size
    # mid-upload: headers promise 1000 bytes, 10 come, then the connection closes
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {server.api_key}\r\n"
                     "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"prompt\":".encode())
    # mid-stream: leaves after the first token

    async def leave() -> None:
        async with httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=60) as http:
            async with http.stream("POST", "/v1/completions", json={"prompt": "leaving", "max_tokens": 200,
                                                                    "ignore_eos": True, "stream": True}) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        return

    asyncio.run(leave())
    wait_idle(server, 10)
    deadline = time.monotonic() + 30  # "eventually" written: a generous poll, not a figure
    while True:
        with log.open(errors="replace") as f:
            f.seek(start)
            new = f.read()
        if "the client left before sending the whole body" in new and "the client left; request aborted" in new:
            break
        assert time.monotonic() < deadline, new
        time.sleep(0.05)
    lines = [ln for ln in new.splitlines() if "the client left" in ln]
    assert all(" INFO " in ln for ln in lines), lines
    assert "Traceback" not in new and " ERROR " not in new, new
