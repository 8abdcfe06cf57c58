"""Server-side merging (--enable-request-merging): identical concurrent requests share one generation.

To make "concurrent" certain, not a race: the server runs one request at a time
(--max-num-seqs 1) and a long blocker holds that seat until every identical request has
joined (seen in /metrics); then the blocker's client goes away and the shared
generation runs once for all 32.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from expresslane import SamplingParams

from .conftest import API_KEY, Server, metric

PROMPT = "Tell me about merging"
H = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def merging_server():
    s = Server("--enable-request-merging", "--max-num-seqs", "1", "--max-model-len", "2048", "--batch-store", "none")
    try:
        yield s.wait_ready()
    finally:
        s.stop()


async def wait_for(server, name: str, value: float, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while metric(await asyncio.to_thread(server.metrics), name) < value:
        assert time.monotonic() < deadline, f"{name} never reached {value}"
        await asyncio.sleep(0.05)


async def stream_text(c: httpx.AsyncClient, url: str, body: dict) -> tuple[str, dict]:
    text, usage = "", None
    async with c.stream("POST", url, json={**body, "stream": True, "stream_options": {"include_usage": True}},
                        headers=H) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                text += "".join(ch["text"] for ch in event["choices"])
                usage = event.get("usage") or usage
    return text, usage


def test_32_identical_greedy_requests_cost_one_generation(merging_server, llm):
    s = merging_server
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 24, "temperature": 0.0, "ignore_eos": True}
    url = s.url + "/v1/completions"

    async def go():
        async with httpx.AsyncClient(timeout=300) as c:
            blocker = {"model": "tiny", "prompt": "hold the seat", "max_tokens": 2000, "ignore_eos": True,
                       "temperature": 1.0, "stream": True}  # sampled without a seed: never merged
            async with c.stream("POST", url, json=blocker, headers=H) as held:
                async for line in held.aiter_lines():
                    if line.startswith("data: "):
                        break  # it runs: the only seat is taken
                plain = [asyncio.create_task(c.post(url, json=body, headers=H)) for _ in range(16)]
                streamed = [asyncio.create_task(stream_text(c, url, body)) for _ in range(16)]
                await wait_for(s, "expresslane:request_merge_hits_total", 31)
            # the blocker's client is gone: it is aborted and the shared generation runs
            return [r.json() for r in await asyncio.gather(*plain)], await asyncio.gather(*streamed)

    before = s.metrics()
    plain, streamed = asyncio.run(go())
    after = s.metrics()
    [ref] = llm.generate([PROMPT], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True), use_tqdm=False)
    full = ref.outputs[0].text
    assert all(r["choices"][0]["text"] == full and r["usage"]["completion_tokens"] == 24 for r in plain)
    assert all(text == full and usage["completion_tokens"] == 24 for text, usage in streamed)

    def delta(name, **labels):
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert delta("expresslane:request_merge_queries_total") == 32
    assert delta("expresslane:request_merge_hits_total") == 31
    # the engine finished one request (and aborted the blocker), and generated the 24 tokens once
    assert delta("expresslane:request_success_total", finished_reason="length") == 1
    assert delta("expresslane:request_success_total", finished_reason="abort") == 1
    blocker_tokens = delta("expresslane:generation_tokens_total") - 24
    assert 0 < blocker_tokens < 2000


def test_sampled_requests_without_a_seed_are_not_merged(merging_server):
    before = merging_server.metrics()
    for _ in range(2):
        r = httpx.post(merging_server.url + "/v1/completions", headers=H, timeout=60,
                       json={"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "temperature": 1.0})
        assert r.status_code == 200
    after = merging_server.metrics()
    assert metric(after, "expresslane:request_merge_queries_total") == metric(before,
                                                                              "expresslane:request_merge_queries_total")


class _FakeGroup:
    """Stands in for the engine client's RequestGroup: outputs fed by the test."""

    def __init__(self):
        self.tracked = {"r": None}
        self.queue: asyncio.Queue = asyncio.Queue()
        self.closed = 0

    async def outputs(self):
        while True:
            out = await self.queue.get()
            yield out
            if out.finished:
                return

    def close(self):
        self.closed += 1

    def engine_arrival_time(self, rid):
        return 1.0


class _FakeClient:
    def __init__(self):
        self.groups = []

    def submit(self, request_id, prompts, params, *, priority, lane, timeout):
        self.groups.append(_FakeGroup())
        return self.groups[-1]


def test_a_late_subscriber_gets_everything_so_far_and_the_last_to_leave_aborts():
    from prometheus_client import CollectorRegistry

    from expresslane.outputs import CompletionOutput, RequestMetrics, RequestOutput
    from expresslane.server.merging import RequestMerger

    def out(text, done=False):
        return RequestOutput("r", None, [1, 2], [CompletionOutput(0, text, [], "length" if done else None)], done,
                             RequestMetrics(0.0))

    async def go():
        client = _FakeClient()
        m = RequestMerger(client, CollectorRegistry(), "tiny")
        greedy = SamplingParams(max_tokens=3, temperature=0.0)
        a = m.submit("a", [(None, [1, 2])], greedy, priority=0, lane=None, timeout=None)
        client.groups[0].queue.put_nowait(out("x"))
        await asyncio.sleep(0)  # let the pump deliver it
        await asyncio.sleep(0)
        b = m.submit("b", [(None, [1, 2])], greedy, priority=0, lane=None, timeout=None)
        assert len(client.groups) == 1 and b.queue.qsize() == 1  # joined, with the output so far
        other = m.submit("c", [(None, [1, 2])], SamplingParams(max_tokens=4, temperature=0.0), priority=0,
                         lane=None, timeout=None)
        assert len(client.groups) == 2  # other parameters: its own generation
        a.close()
        assert client.groups[0].closed == 0  # b still reads it
        client.groups[0].queue.put_nowait(out("xyz", done=True))
        got = [o.outputs[0].text async for o in b.outputs()]
        assert got[-1] == "xyz" and client.groups[0].closed == 0
        other.close()
        assert client.groups[1].closed == 1  # its last reader left: aborted
        again = m.submit("d", [(None, [1, 2])], greedy, priority=0, lane=None, timeout=None)
        assert len(client.groups) == 3 and again is not b  # the finished generation is not joined
        again.close()

    asyncio.run(go())
