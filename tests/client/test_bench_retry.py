"""The benchmark client honours Retry-After on 429/503 (and only there)."""

from __future__ import annotations

import asyncio

import aiohttp

from expresslane.bench.client import Endpoint, retry_wait, send_request

from .test_client import chunk

DONE = {"id": "cmpl-1", "object": "text_completion", "choices": [{"index": 0, "text": "b", "finish_reason": "length"}]}


def send(scripted, script):
    scripted.script[:] = script
    scripted.bodies.clear()

    async def go():
        async with aiohttp.ClientSession() as session:
            return await send_request(session, Endpoint(scripted.url, "m"), "hello", 1, 2)

    return asyncio.run(go())


def test_a_503_with_retry_after_is_sent_again(scripted):
    rec = send(scripted, [("error", 503, {"Retry-After": "0"}), ("stream", [chunk("a"), DONE], True)])
    assert rec.success and rec.error in (None, "") and len(scripted.bodies) == 2


def test_refusals_without_retry_after_fail_at_once(scripted):
    rec = send(scripted, [("error", 503, {}), ("stream", [chunk("a"), DONE], True)])
    assert not rec.success and rec.error.startswith("HTTP 503") and len(scripted.bodies) == 1


def test_retry_wait_is_the_stated_delay_a_few_times():
    assert 2.0 <= retry_wait(429, "2", 0) <= 2.2
    assert retry_wait(429, "2", 3) is None  # three retries at most
    assert retry_wait(500, "2", 0) is None and retry_wait(503, None, 0) is None and retry_wait(503, "x", 0) is None
