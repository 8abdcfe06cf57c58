"""Tool calling through the server with the openai SDK: forced (named and required) calls
whose arguments validate against the tool's schema even from the built-in 9M model, plain
and streamed; a multi-turn loop sent back with the SDK's own ``model_dump()``; the parsers
for ``auto``; ``tool_choice: none`` (the tools reach the template, no calls are read)."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest
from openai import OpenAI

from expresslane.server.tools import CallStream, ToolMode, parse_hermes, parse_llama3_json, parse_mistral

from .conftest import API_KEY, Server

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "days", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}


def _valid(call) -> None:
    assert call.type == "function" and call.id
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_named_tool_choice_returns_a_valid_call(openai_client):
    done = openai_client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=[WEATHER, TIME], max_tokens=80, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    _valid(call)


@pytest.mark.parametrize("parallel", [True, False])
def test_required_returns_valid_calls(openai_client, parallel):
    done = openai_client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=[WEATHER, TIME], max_tokens=120, temperature=1.0, seed=5,
        tool_choice="required", parallel_tool_calls=parallel)
    calls = done.choices[0].message.tool_calls
    assert calls and done.choices[0].finish_reason == "tool_calls"
    assert parallel or len(calls) == 1
    for call in calls:
        _valid(call)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_streamed_calls_add_up_to_the_plain_ones(openai_client, tool_choice):
    kwargs = dict(model="tiny", messages=MESSAGES, tools=[WEATHER, TIME], max_tokens=100, temperature=0,
                  tool_choice=tool_choice)
    plain = openai_client.chat.completions.create(**kwargs).choices[0].message.tool_calls
    calls: dict[int, dict] = {}
    finish = None
    for chunk in openai_client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for d in choice.delta.tool_calls or []:
                c = calls.setdefault(d.index, {"name": "", "arguments": "", "id": None})
                c["id"] = c["id"] or d.id
                c["name"] += d.function.name or ""
                c["arguments"] += d.function.arguments or ""
    assert finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        (p.function.name, json.loads(p.function.arguments)) for p in plain]
    assert all(c["id"] for c in calls.values())


def test_a_tool_loop_sends_the_sdk_message_back(openai_client):
    messages = list(MESSAGES)
    first = openai_client.chat.completions.create(
        model="tiny", messages=messages, tools=[WEATHER], max_tokens=80, temperature=0, tool_choice="required")
    msg = first.choices[0].message
    messages.append(msg.model_dump())  # refusal, annotations, audio, function_call: null; content: null
    for call in msg.tool_calls:
        messages.append({"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"})
    second = openai_client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER], max_tokens=10,
                                                   temperature=0)
    assert second.choices[0].message.content is not None or second.choices[0].message.tool_calls


@pytest.mark.parametrize("body, field", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [], "tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
])
def test_bad_tool_requests_are_400s_naming_the_field(server, body, field):
    r = httpx.post(server.url + "/v1/chat/completions", headers=server.headers, timeout=30,
                   json={"messages": MESSAGES, "max_tokens": 5, "tools": [WEATHER], **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field, r.json()


def test_parsers_read_the_families_formats():
    content, calls = parse_hermes('Let me check.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>')
    assert content == "Let me check." and [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"a": 1})]
    assert parse_hermes("no call here") == ("no call here", [])
    _, calls = parse_llama3_json('{"name": "g", "parameters": {"b": "x"}}; {"name": "h", "parameters": {}}')
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("g", {"b": "x"}), ("h", {})]
    content, calls = parse_mistral('[TOOL_CALLS][{"name": "k", "arguments": {"c": [1]}}]')
    assert content is None and calls[0].name == "k" and json.loads(calls[0].arguments) == {"c": [1]}


def test_auto_streaming_holds_a_call_until_it_closes():
    stream = CallStream(ToolMode("auto", [WEATHER], parser="hermes"))
    text = 'Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    content, deltas = "", []
    for i in range(0, len(text), 4):
        c, d = stream.feed(text[i:i + 4], finished=False)
        content, deltas = content + c, deltas + d
        if "</tool_call>" not in text[:i + 4]:
            assert not deltas  # nothing of the call before it closes
    assert content.strip() == "Sure." and len(deltas) == 1
    assert json.loads(deltas[0]["function"]["arguments"]) == {"city": "Oslo"}


# a template that shows the tools it gets: the prompt grows by their names
TOOLS_TEMPLATE = ("{% for t in tools or [] %}tool {{ t.function.name }}\n{% endfor %}{% for m in messages %}"
                  "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}<|im_start|>assistant\n")
CALL_TEXT = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 1, "unit": "c"}}</tool_call>'


def _prompt_tokens(client, **kw) -> int:
    return client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1, extra_body={
        "chat_template": TOOLS_TEMPLATE}, **kw).usage.prompt_tokens


def test_tool_choice_none_shows_the_tools_and_reads_no_calls(openai_client):
    bare = _prompt_tokens(openai_client)
    assert _prompt_tokens(openai_client, tools=[WEATHER, TIME], tool_choice="none") == \
        _prompt_tokens(openai_client, tools=[WEATHER, TIME], tool_choice="auto") > bare
    kw = dict(model="tiny", messages=MESSAGES, max_tokens=200, temperature=0, tools=[WEATHER], extra_body={"guided_regex": re.escape(
        CALL_TEXT)})
    none = openai_client.chat.completions.create(tool_choice="none", **kw).choices[0]
    assert none.message.content == CALL_TEXT and not none.message.tool_calls and none.finish_reason == "stop"
    auto = openai_client.chat.completions.create(tool_choice="auto", **kw).choices[0]
    assert auto.finish_reason == "tool_calls" and auto.message.tool_calls[0].function.name == "get_weather"


def test_the_flag_leaves_the_tools_out_with_none():
    server = Server("--exclude-tools-when-tool-choice-none").wait_ready()
    try:
        client = OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
        assert _prompt_tokens(client, tools=[WEATHER], tool_choice="none") == _prompt_tokens(client) < \
            _prompt_tokens(client, tools=[WEATHER])
    finally:
        server.stop()
