"""`expresslane serve --pd-lanes on` (issue #45): long prompts in the prefill lane beside short ones
and decodes in the other, through the `openai` SDK, greedy text equal to the offline engine's
(which runs one lane), and the mode in /metrics, /load and the doctor's line."""

from __future__ import annotations

import asyncio

import aiohttp
import httpx
import pytest
from openai import AsyncOpenAI

from expresslane import SamplingParams
from expresslane.bench.doctor import detect_server
from expresslane.bench.client import Endpoint

from .conftest import API_KEY, Server, metric

LONG = "def merge(a, b):\n" + "    x = a + b\n" * 20  # past the prefill cap (64 // 4 tokens): the prefill lane
SHORTS = ["import os", "class A:", "for i in range(3):"]


@pytest.fixture(scope="module")
def lanes_server():
    s = Server("--pd-lanes", "on", "--max-num-batched-tokens", "64")
    try:
        yield s.wait_ready()
    finally:
        s.stop()


def test_two_lanes_serve_the_offline_engine_s_greedy_text_and_report_their_split(lanes_server, llm):
    s = lanes_server
    client = AsyncOpenAI(base_url=s.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)

    async def complete(prompt: str) -> str:
        text = ""
        stream = await client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0.0,
                                                 stream=True)
        async for chunk in stream:
            text += chunk.choices[0].text
        return text

    async def main() -> list[str]:
        return await asyncio.gather(complete(LONG), *(complete(p) for p in SHORTS))

    got = asyncio.run(main())
    want = [o.outputs[0].text for o in llm.generate([LONG, *SHORTS], SamplingParams(temperature=0.0, max_tokens=12),
                                                    use_tqdm=False)]
    assert got == want

    m = s.metrics()
    assert metric(m, "expresslane:pd_lane_busy_seconds_total", step_lane="prefill") > 0
    assert metric(m, "expresslane:pd_lane_busy_seconds_total", step_lane="decode") > 0
    assert metric(m, "expresslane:pd_lane_sms", step_lane="decode") > 0  # idle: every SM to the decode lane
    assert metric(m, "expresslane:pd_lane_sms", step_lane="prefill") == 0
    assert httpx.get(s.url + "/load", headers=s.headers).json()["pd_lanes"] == "on"

    async def detect() -> dict:
        async with aiohttp.ClientSession() as session:
            return await detect_server(session, Endpoint(s.url, "tiny", headers=s.headers))

    assert asyncio.run(detect())["pd_lanes"] == "on"
