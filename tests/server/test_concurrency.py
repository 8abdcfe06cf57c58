"""Many streams at once: each gets its own output; dropped clients free their slots and KV."""

from __future__ import annotations

import asyncio
import time

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
    """Seconds until /metrics shows no running or waiting request and an empty KV cache."""
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
    wait_idle(server, 10)
    aborts_before = metric(server.metrics(), "expresslane:request_success_total", finished_reason="abort")
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

    async def drop_plain(http: httpx.AsyncClient, i: int) -> None:
        try:
            await http.post("/v1/completions", json={**body, "stream": False, "prompt": f"Plain {i}"}, timeout=0.2)
        except httpx.TimeoutException:
            return
        raise AssertionError("a 200-token request finished within 0.2 s")

    async def main():
        async with httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=60) as http:
            await asyncio.gather(*(drop_stream(http, i) for i in range(20)), *(drop_plain(http, i) for i in range(4)))

    asyncio.run(main())
    took, m = wait_idle(server, 2.0)
    assert metric(m, "expresslane:request_success_total", finished_reason="abort") - aborts_before == 24
