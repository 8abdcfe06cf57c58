"""Client-side merging against `expresslane serve`: many small calls, one HTTP request, each caller its answer."""

from __future__ import annotations

import asyncio

from expresslane import SamplingParams
from expresslane.client import APIStatusError, Client, CompletionMerger

from .conftest import API_KEY, MAX_MODEL_LEN


def test_50_calls_in_one_window_are_one_request_with_each_callers_answer(server, llm):
    prompts = [f"merge me {i}" for i in range(50)]

    async def go():
        async with Client(server.url, API_KEY) as c:
            m = CompletionMerger(c, window=0.05, max_prompts=64)
            answers = await asyncio.gather(*(m.complete(p, model="tiny", max_tokens=4, temperature=0.0,
                                                        ignore_eos=True) for p in prompts))
            return answers, c.requests_sent

    answers, sent = asyncio.run(go())
    assert sent == 1
    refs = llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    for a, ref in zip(answers, refs):
        assert [c["index"] for c in a["choices"]] == [0]
        assert a["choices"][0]["text"] == ref.outputs[0].text
        assert a["merged"]["num_prompts"] == 50 and a["merged"]["usage"]["completion_tokens"] == 200


def test_different_parameters_do_not_merge_and_a_bad_prompt_fails_alone(server, llm):
    async def go():
        async with Client(server.url, API_KEY) as c:
            m = CompletionMerger(c, window=0.05)
            calls = [m.complete("short one", model="tiny", max_tokens=2, temperature=0.0),
                     m.complete("short two", model="tiny", max_tokens=2, temperature=0.0),
                     m.complete("word " * MAX_MODEL_LEN, model="tiny", max_tokens=2, temperature=0.0),
                     m.complete("other params", model="tiny", max_tokens=3, temperature=0.0, n=2, seed=5)]
            return await asyncio.gather(*calls, return_exceptions=True), c.requests_sent

    (one, two, bad, other), sent = asyncio.run(go())
    assert isinstance(bad, APIStatusError) and bad.status == 400
    # two groups; the first was refused as a whole (the long prompt), then sent prompt by prompt
    assert sent == 2 + 3
    ref = llm.generate(["short one", "short two"], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)
    assert [one["choices"][0]["text"], two["choices"][0]["text"]] == [o.outputs[0].text for o in ref]
    assert [c["index"] for c in other["choices"]] == [0, 1]
