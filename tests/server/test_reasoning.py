"""--reasoning-parser: a reasoning model's thinking goes to reasoning_content, in the message and in
stream deltas. The built-in model is held by a regex to write a think section and an answer."""

from __future__ import annotations

import re

import pytest
from openai import OpenAI

from expresslane.server.reasoning import ReasoningStream, split

from .conftest import API_KEY, Server

PATTERN = r"<think>[a-z]{2,6}( [a-z]{2,6}){1,3}</think>\n[A-Z][a-z]{2,8}\."
MESSAGES = [{"role": "user", "content": "Think, then answer."}]


@pytest.fixture(scope="module")
def qwen3_server():
    s = Server("--reasoning-parser", "qwen3").wait_ready()
    yield s
    s.stop()


def test_message_and_stream_split_the_thinking(qwen3_server):
    client = OpenAI(base_url=qwen3_server.url + "/v1", api_key=API_KEY, max_retries=0)
    kwargs = dict(model="tiny", messages=MESSAGES, max_tokens=60, temperature=0, extra_body={"guided_regex": PATTERN})
    msg = client.chat.completions.create(**kwargs).choices[0].message
    thought, answer = msg.model_extra["reasoning_content"], msg.content
    assert re.fullmatch(r"[a-z]{2,6}( [a-z]{2,6}){1,3}", thought) and re.fullmatch(r"[A-Z][a-z]{2,8}\.", answer)
    streamed_thought = streamed_answer = ""
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        delta = chunk.choices[0].delta
        streamed_thought += (delta.model_extra or {}).get("reasoning_content") or ""
        streamed_answer += delta.content or ""
    assert (streamed_thought, streamed_answer) == (thought, answer)


def test_without_a_think_section_all_is_content(qwen3_server):
    client = OpenAI(base_url=qwen3_server.url + "/v1", api_key=API_KEY, max_retries=0)
    msg = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5, temperature=0,
                                         extra_body={"guided_regex": "[A-Z][a-z]{3}"}).choices[0].message
    assert msg.model_extra["reasoning_content"] is None and re.fullmatch("[A-Z][a-z]{3}", msg.content)


@pytest.mark.parametrize("parser, text, want", [
    ("qwen3", "<think>\nhmm, two\n</think>\n\nFour.", ("hmm, two", "Four.")),
    ("qwen3", "Four.", (None, "Four.")),
    ("qwen3", "<think>cut short", ("cut short", "")),
    ("deepseek_r1", "so it is four</think>\n\nFour.", ("so it is four", "Four.")),
    ("deepseek_r1", "<think>x</think>y", ("x", "y")),
    ("deepseek_r1", "still thinking", ("still thinking", "")),
])
def test_split_and_its_stream_agree(parser, text, want):
    assert split(parser, text) == want
    for step in (1, 3, 7):
        stream, thought, answer = ReasoningStream(parser), "", ""
        for i in range(0, len(text), step):
            r, c = stream.feed(text[i:i + step], finished=i + step >= len(text))
            thought, answer = thought + r, answer + c
        assert (thought or None, answer) == want
