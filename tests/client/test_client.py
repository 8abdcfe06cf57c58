"""expresslane.client against a real HTTP server that answers from a script.

Time is simulated: the client's ``sleep`` records the delays it asked for and returns.
"""

from __future__ import annotations

import asyncio
import random
from email.utils import formatdate

import pytest

from expresslane.client import APIStatusError, Backoff, Client, StreamInterrupted, parse_retry_after


class Sleeps(list):
    async def __call__(self, seconds: float) -> None:
        self.append(seconds)


def run_client(scripted, script, fn, **kwargs):
    scripted.script[:] = script
    scripted.bodies.clear()
    sleeps = Sleeps()

    async def go():
        async with Client(scripted.url + "/v1", "k", sleep=sleeps, rng=random.Random(0), **kwargs) as c:
            try:
                return await fn(c), c.requests_sent
            except Exception as e:  # noqa: BLE001
                return e, c.requests_sent

    result, sent = asyncio.run(go())
    return result, sent, sleeps


OK = {"id": "cmpl-1", "object": "text_completion", "choices": [{"index": 0, "text": "hi", "finish_reason": "length"}]}


def chunk(text):
    return {"id": "cmpl-1", "object": "text_completion", "choices": [{"index": 0, "text": text, "finish_reason": None}]}


def test_503_with_retry_after_is_retried_after_the_stated_delay(scripted):
    result, sent, sleeps = run_client(scripted, [("error", 503, {"Retry-After": "7"}), ("json", OK)],
                                      lambda c: c.completions(model="m", prompt="x", max_tokens=1))
    assert result == OK and sent == 2
    assert len(sleeps) == 1 and 7.0 <= sleeps[0] <= 7.0 * 1.1  # the stated delay, plus at most 10% jitter
    assert scripted.bodies[0] == scripted.bodies[1] == {"model": "m", "prompt": "x", "max_tokens": 1,
                                                        "lane": "interactive"}


def test_without_retry_after_backoff_is_jittered_exponential_and_bounded(scripted):
    b = Backoff(max_retries=3, base=0.5, cap=30)
    result, sent, sleeps = run_client(scripted, [("error", 502, {})] * 4,
                                      lambda c: c.completions(model="m", prompt="x"), backoff=b)
    assert isinstance(result, APIStatusError) and result.status == 502 and sent == 4
    assert len(sleeps) == 3 and all(0 <= s <= 0.5 * 2 ** k for k, s in enumerate(sleeps))
    rng = random.Random(1)  # full jitter: the draws spread over the window, not at its edge
    draws = [b.delay(4, None, rng) for _ in range(200)]
    assert 0 <= min(draws) < 1 and 7 < max(draws) <= 8


def test_client_errors_are_not_retried(scripted):
    result, sent, sleeps = run_client(scripted, [("error", 400, {})], lambda c: c.completions(model="m", prompt="x"))
    assert isinstance(result, APIStatusError) and result.status == 400 and (sent, sleeps) == (1, [])


def test_a_stream_is_retried_before_its_first_event_only(scripted):
    async def collect(c):
        return [e["choices"][0]["text"] async for e in c.stream_completions(model="m", prompt="x", lane="batch")]

    result, sent, sleeps = run_client(
        scripted, [("error", 429, {"Retry-After": "3"}), ("stream", [chunk("a"), chunk("b")], True)], collect)
    assert result == ["a", "b"] and sent == 2 and len(sleeps) == 1 and 3 <= sleeps[0] <= 3.3
    assert scripted.bodies[1]["stream"] is True and scripted.bodies[1]["lane"] == "batch"

    got: list[str] = []

    async def collect_until_cut(c):
        async for e in c.stream_completions(model="m", prompt="x"):
            got.append(e["choices"][0]["text"])

    result, sent, sleeps = run_client(scripted, [("stream", [chunk("a"), chunk("b")], False), ("json", OK)],
                                      collect_until_cut)
    assert isinstance(result, StreamInterrupted) and got == ["a", "b"]
    assert sent == 1 and sleeps == [] and scripted.script == [("json", OK)]  # never sent again


def test_retry_after_parsing_and_lane_timeouts():
    assert parse_retry_after("120") == 120.0 and parse_retry_after(" 1.5 ") == 1.5
    assert parse_retry_after(formatdate(1000 + 30, usegmt=True), now=1000.0) == 30.0
    assert parse_retry_after(None) is None and parse_retry_after("soon") is None
    assert Backoff(max_wait=60).delay(0, "3600", random.Random(0)) <= 66  # a huge Retry-After is capped
    c = Client("http://127.0.0.1:1/v1", timeouts={"batch": 5.0})
    assert c._timeout("batch").read == 5.0 and c._timeout("interactive").read == 60.0
    with pytest.raises(ValueError, match="unknown lane"):
        c._timeout("express")
    asyncio.run(c.aclose())
