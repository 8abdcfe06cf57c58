"""Issue #19 item 0: requests with and without logprobs, n > 1 and preemption in the same
engine steps, through a real server. Before the fix, a step that sampled for both kinds
of request sent ``new_logprobs: [None]`` and the API process declared the engine dead."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from expresslane import SamplingParams

from .conftest import Server, metric

PROMPTS = ["first request without logprobs", "one more prompt", "and a third one here", "the fourth"]
LONG = 120  # tokens of each completion of the request without logprobs: it runs for many steps


@pytest.fixture(scope="module")
def tight_server():
    # 20 blocks of 16 tokens: the 8 sequences of the long request alone need 64, so the engine preempts;
    # under the priority policy the later requests (priority -1) run beside what is left of it.
    s = Server("--num-kv-blocks", "20", "--scheduling-policy", "priority")
    try:
        yield s.wait_ready()
    finally:
        s.stop()


def test_logprobs_and_plain_requests_share_steps_with_n_and_preemption(tight_server, llm):
    s = tight_server
    preemptions = metric(s.metrics(), "expresslane:num_preemptions_total")

    async def main():
        async with httpx.AsyncClient(base_url=s.url, headers=s.headers, timeout=120) as http:
            first_chunk = asyncio.Event()

            async def stream(body: dict) -> list:
                events = []
                async with http.stream("POST", "/v1/completions", json={
                        **body, "stream": True, "stream_options": {"include_usage": True},
                        "return_metrics": True}) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
                            first_chunk.set()
                return events

            plain = asyncio.create_task(stream({"prompt": PROMPTS, "n": 2, "max_tokens": LONG, "ignore_eos": True,
                                                "temperature": 0.0}))
            await first_chunk.wait()  # it is decoding: the next ones share its steps
            with_lp = stream({"prompt": "second request with logprobs", "max_tokens": 8, "logprobs": 1, "n": 2,
                              "temperature": 0.0, "priority": -1})
            chat = http.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "chat with logprobs"}], "max_tokens": 6,
                "logprobs": True, "top_logprobs": 2, "priority": -1})
            results = await asyncio.gather(plain, with_lp, chat)
            return *results, (await http.get("/health")).json()

    events, lp_events, chat, health = asyncio.run(main())
    assert health == {"status": "ok"}
    for evs in (lp_events, events):
        assert evs[-1] == "[DONE]" and all("error" not in e for e in evs[:-1]), evs[-3:]
    # the plain request: no logprobs, every completion as the offline engine writes it
    texts = {}
    for e in events[:-2]:
        for c in e["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
            assert c["logprobs"] is None
    refs = llm.generate(PROMPTS, SamplingParams(n=2, max_tokens=LONG, ignore_eos=True, temperature=0.0),
                        use_tqdm=False)
    assert texts == {i * 2 + c.index: c.text for i, ref in enumerate(refs) for c in ref.outputs}
    assert events[-2]["usage"]["completion_tokens"] == len(PROMPTS) * 2 * LONG
    # the logprobs request ran beside it (engine timestamps), with one entry per token
    plain_finished = max(m["finished_time"] for m in events[-2]["metrics"])
    assert lp_events[-2]["metrics"]["first_token_time"] < plain_finished
    tokens = {0: 0, 1: 0}
    for e in lp_events[:-2]:
        for c in e["choices"]:
            lp = c["logprobs"]
            assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"])
            assert all(isinstance(x, float) for x in lp["token_logprobs"])
            tokens[c["index"]] += len(lp["tokens"])
    assert sum(tokens.values()) == lp_events[-2]["usage"]["completion_tokens"]
    assert chat.status_code == 200, chat.text
    content = chat.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == chat.json()["usage"]["completion_tokens"]
    assert all(len(t["top_logprobs"]) == 2 for t in content)

    assert metric(s.metrics(), "expresslane:num_preemptions_total") > preemptions
