"""--reasoning-parser: a reasoning model's thinking goes to reasoning_content, in the message and in
stream deltas. The built-in model is held by a regex to write a think section and an answer
(--structured-outputs-enable-in-reasoning: the grammar holds the thinking too); by default a grammar
holds the answer only, after </think>, or from the start when the prompt closed the thinking."""

from __future__ import annotations

import json
import re

import pytest
from openai import OpenAI

from expresslane.server.reasoning import ReasoningStream, split, thinking_ended

from .conftest import API_KEY, Server

PATTERN = r"<think>[a-z]{2,6}( [a-z]{2,6}){1,3}</think>\n[A-Z][a-z]{2,8}\."
MESSAGES = [{"role": "user", "content": "Think, then answer."}]


@pytest.fixture(scope="module")
def qwen3_server():
    s = Server("--reasoning-parser", "qwen3", "--structured-outputs-enable-in-reasoning").wait_ready()
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


# Qwen3's switch, as its template writes it: with enable_thinking false the prompt closes the thinking
QWEN3_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                  "<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}"
                  "<think>\n\n</think>\n\n{% endif %}")
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}, "n": {"type": "integer"}},
          "required": ["answer", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def after_thinking():
    """The default: a grammar starts after the thinking."""
    s = Server("--reasoning-parser", "qwen3", "--chat-template", QWEN3_TEMPLATE).wait_ready()
    yield OpenAI(base_url=s.url + "/v1", api_key=API_KEY, max_retries=0)
    s.stop()


def test_a_grammar_waits_for_the_end_of_the_thinking(after_thinking):
    """The built-in model never writes </think>: its output stays free text, not the one choice."""
    for extra in ({"guided_choice": ["yes"]}, {"response_format": {"type": "json_object"}}):
        body = {**extra, "ignore_eos": True}
        msg = after_thinking.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, temperature=0,
                                                     extra_body=body).choices[0].message
        assert msg.content not in ("yes", "") and not msg.content.startswith("{"), msg.content


def test_a_prompt_that_closed_the_thinking_is_held_from_the_start(after_thinking):
    """Qwen3's enable_thinking false: the answer is held to the schema from its first token."""
    done = after_thinking.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=60, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}},
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    value = json.loads(done.choices[0].message.content)
    assert set(value) == {"answer", "n"} and isinstance(value["n"], int)
    assert done.choices[0].message.model_extra["reasoning_content"] is None


def test_thinking_ended_reads_the_last_tag():
    assert thinking_ended("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not thinking_ended("<|im_start|>assistant\n<think>\n")  # deepseek_r1's template opens it
    assert not thinking_ended("<think>a</think>b<|im_start|>assistant\n<think>")
    assert not thinking_ended("<|im_start|>assistant\n")  # qwen3 with thinking: the model opens it
