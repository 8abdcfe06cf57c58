"""POST /v1/responses against a real server on the built-in model, with the openai SDK's
``client.responses``, raw SSE checked event by event against the SDK's own pydantic types, the
OpenAI Agents SDK's default (Responses) model and LangChain's ``use_responses_api``. Greedy outputs
are compared with the chat completions endpoint's for the same conversation: the Responses API is
a translation of it, so text, calls and token counts must agree."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import BaseModel, TypeAdapter

from expresslane.sampling_params import SamplingParams
from expresslane.server import errors
from expresslane.server.response_events import Responses, _EventWriter
from expresslane.server.responses import parse_responses

from .conftest import API_KEY, MAX_MODEL_LEN, Server

EVENT = TypeAdapter(ResponseStreamEvent)
WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                  "required": ["city", "days"], "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": WEATHER_PARAMS, "strict": True}
CLOCK = {"type": "function", "name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}
SCHEMAS = {"get_weather": WEATHER_PARAMS, "get_time": CLOCK["parameters"]}
QUESTION = "What is the weather in Paris?"


class Person(BaseModel):
    name: str
    age: int


def _stream(server: Server, body: dict) -> list:
    """The raw SSE of a streamed response, each event validated by the openai package's types."""
    events = []
    with httpx.stream("POST", server.url + "/v1/responses", headers=server.headers, timeout=60,
                      json={"model": "tiny", "stream": True, **body}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: "):
                event = EVENT.validate_python(json.loads(line.removeprefix("data: ")))
                assert event.type == name
                events.append(event)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    return events


def _final(events: list) -> Response:
    assert events[-1].type in ("response.completed", "response.incomplete")
    response = Response.model_validate(events[-1].response.model_dump())
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [i.model_dump() for i in done] == [i.model_dump() for i in response.output]
    return response


def _chat(client, messages, **kwargs):
    return client.chat.completions.create(model="tiny", messages=messages, temperature=0, **kwargs)


@pytest.mark.parametrize("instructions", [None, "Answer in one word."])
def test_text_matches_chat_completions(openai_client, instructions):
    kwargs = {"instructions": instructions} if instructions else {}
    r = openai_client.responses.create(model="tiny", input="Hello there", max_output_tokens=12, temperature=0,
                                       metadata={"run": "a"}, **kwargs)
    Response.model_validate(r.model_dump())
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + [
        {"role": "user", "content": "Hello there"}]
    chat = _chat(openai_client, messages, max_tokens=12)
    assert r.id.startswith("resp_") and r.object == "response" and r.store is False
    assert r.output_text == chat.choices[0].message.content
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    cut = chat.choices[0].finish_reason == "length"
    assert r.status == ("incomplete" if cut else "completed")
    assert (r.incomplete_details.reason if cut else r.incomplete_details) == ("max_output_tokens" if cut else None)
    assert (r.instructions, r.max_output_tokens, r.temperature, r.metadata) == (instructions, 12, 0.0, {"run": "a"})


def test_stream_events_add_up_to_the_response(server, openai_client):
    body = {"input": "Tell me a story", "max_output_tokens": 16, "temperature": 0}
    plain = openai_client.responses.create(model="tiny", **body)
    events = _stream(server, body)
    final = _final(events)
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    [done] = [e for e in events if e.type == "response.output_text.done"]
    assert deltas == done.text == final.output_text == plain.output_text
    assert final.usage.output_tokens == plain.usage.output_tokens and final.status == plain.status
    kinds = [e.type for e in events]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    # the SDK's own stream reads the same events
    assert [e.type for e in openai_client.responses.create(model="tiny", stream=True, **body)] == kinds


def test_json_schema_format_parses(openai_client):
    r = openai_client.responses.parse(model="tiny", input="Describe a person.", text_format=Person,
                                      max_output_tokens=60, temperature=0)
    assert isinstance(r.output_parsed, Person) and r.status == "completed"
    assert r.text.format.type == "json_schema" and r.text.format.name == "Person"
    obj = openai_client.responses.create(model="tiny", input="Any JSON object.", max_output_tokens=40,
                                         temperature=0, text={"format": {"type": "json_object"}})
    assert isinstance(json.loads(obj.output_text), dict)


def _valid_call(item, name: str | None = None) -> None:
    assert item.type == "function_call" and item.call_id.startswith("call_") and item.status == "completed"
    assert name is None or item.name == name
    jsonschema.validate(json.loads(item.arguments), SCHEMAS[item.name])


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "name": "get_weather"}])
def test_forced_call_plain_and_streamed(server, openai_client, tool_choice):
    body = {"input": QUESTION, "tools": [WEATHER, CLOCK], "tool_choice": tool_choice, "max_output_tokens": 80,
            "temperature": 0}
    plain = openai_client.responses.create(model="tiny", **body)
    assert plain.status == "completed" and plain.output
    for item in plain.output:
        _valid_call(item, None if tool_choice == "required" else "get_weather")
    assert plain.tool_choice == tool_choice if isinstance(tool_choice, str) else plain.tool_choice.name == "get_weather"
    events = _stream(server, body)
    final = _final(events)
    args = {}
    for e in events:
        if e.type == "response.function_call_arguments.delta":
            args[e.output_index] = args.get(e.output_index, "") + e.delta
    done = {e.output_index: e for e in events if e.type == "response.function_call_arguments.done"}
    assert {i: d.arguments for i, d in done.items()} == args
    assert [(i.name, json.loads(i.arguments)) for i in final.output] == [
        (i.name, json.loads(i.arguments)) for i in plain.output]


def test_a_tool_loop_sends_calls_and_outputs_back(openai_client):
    first = openai_client.responses.create(model="tiny", input=QUESTION, tools=[WEATHER], tool_choice="required",
                                           parallel_tool_calls=False, max_output_tokens=80, temperature=0)
    [call] = first.output
    _valid_call(call, "get_weather")
    items = [{"role": "user", "content": QUESTION}, call,  # the SDK's own object goes back as it came
             {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}]
    second = openai_client.responses.create(model="tiny", input=items, tools=[WEATHER], max_output_tokens=10,
                                            temperature=0)
    chat = _chat(openai_client, [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": None, "tool_calls": [{"id": call.call_id, "type": "function", "function": {
            "name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21 C"}],
        tools=[{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}], max_tokens=10)
    assert second.usage.input_tokens == chat.usage.prompt_tokens > first.usage.input_tokens
    assert second.output_text == (chat.choices[0].message.content or "")


def test_logprobs_when_included(server, openai_client):
    body = {"input": "Hi", "max_output_tokens": 6, "temperature": 0, "top_logprobs": 2,
            "include": ["message.output_text.logprobs"]}
    r = openai_client.responses.create(model="tiny", **body)
    [part] = r.output[0].content
    assert len(part.logprobs) == r.usage.output_tokens
    assert all(len(lp.top_logprobs) == 2 and lp.logprob <= 0 for lp in part.logprobs)
    assert "".join(lp.token for lp in part.logprobs) == part.text
    events = _stream(server, body)
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert [lp.token for lp in streamed] == [lp.token for lp in part.logprobs]  # a prefix-cache hit: approx below
    assert [lp.logprob for lp in streamed] == pytest.approx([lp.logprob for lp in part.logprobs], abs=1e-4)
    assert [lp.token for lp in _final(events).output[0].content[0].logprobs] == [lp.token for lp in streamed]


def test_openai_defaults_sent_explicitly_are_accepted(server):
    r = httpx.post(server.url + "/v1/responses", headers=server.headers, timeout=30, json={
        "model": "tiny",
        "input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]}],
        "max_output_tokens": 4, "store": False, "metadata": {}, "service_tier": "auto", "parallel_tool_calls": True,
        "truncation": "disabled", "include": [], "top_logprobs": 0, "background": False, "tool_choice": "auto",
        "tools": [], "text": {"format": {"type": "text"}, "verbosity": "medium"}, "stream": False, "user": "u1",
        "temperature": 1.0, "top_p": 1.0, "previous_response_id": None, "reasoning": None, "prompt_cache_key": None})
    assert r.status_code == 200, r.text
    assert Response.model_validate(r.json()).usage.output_tokens >= 1


@pytest.mark.parametrize("field", ["store", "previous_response_id", "conversation", "background"])
def test_storage_is_refused(openai_client, field):
    value = {"store": True, "background": True}.get(field, "resp_123")
    with pytest.raises(openai.BadRequestError) as e:
        openai_client.responses.create(model="tiny", input="Hi", max_output_tokens=4, **{field: value})
    assert e.value.body["param"] == field and "keeps no responses" in e.value.body["message"]
    with pytest.raises(openai.NotFoundError) as e:
        openai_client.responses.retrieve("resp_123")
    assert "keeps no responses" in e.value.body["message"]


@pytest.mark.parametrize("body, field", [
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0].type"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input[0].content[0]"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "strin"}}}}, "text.format"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"truncation": "auto"}, "truncation"),
    ({"reasoning": {"effort": "low"}}, "reasoning.effort"),
    ({"max_output_tokens": 100000}, "max_output_tokens"),
    ({"frequency_penalty": 0.5}, "frequency_penalty"),
])
def test_bad_requests_are_400s_naming_the_field(server, body, field):
    r = httpx.post(server.url + "/v1/responses", headers=server.headers, timeout=30,
                   json={"model": "tiny", "input": "Hi", "max_output_tokens": 4, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field, r.json()


def test_a_large_input_is_refused_before_its_validation(server):
    """More items than the context has tokens, in a body large enough to be prechecked (over 64 KiB)."""
    items = [{"role": "user", "content": "x" * 300}] * (MAX_MODEL_LEN + 1)
    r = httpx.post(server.url + "/v1/responses", headers=server.headers, timeout=30,
                   json={"model": "tiny", "input": items, "max_output_tokens": 4})
    assert len(r.request.content) > 64 * 1024
    assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text
    assert r.json()["error"]["code"] == "context_length_exceeded" and "content parts" in r.json()["error"]["message"]


def test_event_writer_switches_items():
    """Text, then a call cut into pieces, then a second call: three items, each closed before the next opens."""
    w = _EventWriter(logprobs=False)
    raw = w.feed({"content": "Let me check."}, None)
    raw += w.feed({"tool_calls": [{"index": 0, "id": "call_a", "type": "function",
                                   "function": {"name": "get_time", "arguments": '{"zo'}}]}, None)
    raw += w.feed({"tool_calls": [{"index": 0, "function": {"arguments": 'ne": "UTC"}'}}]}, None)
    raw += w.feed({"tool_calls": [{"index": 1, "id": "call_b", "type": "function",
                                   "function": {"name": "get_time", "arguments": '{"zone": "CET"}'}}]}, None)
    raw += w.close("tool_calls")
    events = [EVENT.validate_python(json.loads(chunk.split(b"data: ", 1)[1])) for chunk in raw]
    opened = [(e.output_index, e.item.type) for e in events if e.type == "response.output_item.added"]
    closed = [(e.output_index, e.item.type) for e in events if e.type == "response.output_item.done"]
    assert opened == closed == [(0, "message"), (1, "function_call"), (2, "function_call")]
    kinds = [e.type for e in events]
    assert kinds.index("response.output_item.done") < kinds.index("response.function_call_arguments.delta")
    assert [(i["call_id"], json.loads(i["arguments"])) for i in w.items[1:]] == [
        ("call_a", {"zone": "UTC"}), ("call_b", {"zone": "CET"})]
    assert w.items[0]["content"][0]["text"] == "Let me check."


def test_a_failure_after_the_header_is_an_error_event():
    """The engine's error mid-stream (here a request timeout) ends the stream with OpenAI's error event."""
    class Group:
        tracked = {"r": None}

        async def outputs(self):
            raise errors.request_timeout(5.0)
            yield

    client = SimpleNamespace(metrics=SimpleNamespace(error_body=lambda e: e.body()))
    endpoint = Responses(client, "tiny", "resp-1", Group(), SamplingParams(max_tokens=4), False, False,
                         source=parse_responses({"input": "Hi"}))

    async def collect():
        return [EVENT.validate_python(json.loads(chunk.split(b"data: ", 1)[1])) async for chunk in endpoint.stream()]

    events = asyncio.run(collect())
    assert [e.type for e in events] == ["response.created", "response.in_progress", "error"]
    assert events[-1].code == "request_timeout" and events[0].response.id == "resp_1"


def test_openapi_describes_the_body(server):
    spec = httpx.get(server.url + "/openapi.json", timeout=30).json()
    body = spec["components"]["schemas"]["ResponsesRequest"]
    assert {"input", "tools", "text", "store"} <= set(body["properties"])
    assert {"type": "string"} in body["properties"]["input"]["anyOf"]


def test_agents_sdk_default_model_with_a_tool_and_an_output_type(server):
    from agents import Agent, ModelSettings, RunConfig, Runner, function_tool, set_tracing_disabled
    from agents.models.openai_provider import OpenAIProvider
    from agents.models.openai_responses import OpenAIResponsesModel

    set_tracing_disabled(True)  # no trace upload to OpenAI

    @function_tool
    def lookup_age(name: str) -> int:
        """How old someone is."""
        return 42

    provider = OpenAIProvider(base_url=server.url + "/v1", api_key=API_KEY)  # its default: the Responses API
    assert isinstance(provider.get_model("tiny"), OpenAIResponsesModel)
    agent = Agent(name="people", instructions="Describe a person.", model="tiny", tools=[lookup_age],
                  output_type=Person, model_settings=ModelSettings(max_tokens=80, temperature=0))
    result = Runner.run_sync(agent, "Who is Ada?", max_turns=4, run_config=RunConfig(model_provider=provider))
    assert isinstance(result.final_output, Person)
    assert result.raw_responses and all(r.usage.output_tokens > 0 for r in result.raw_responses)
    # a forced first turn: the tool runs, its output goes back as a function_call_output item, and the
    # second turn (tool_choice reset to auto by the SDK) writes the output_type
    caller = agent.clone(model_settings=ModelSettings(max_tokens=80, temperature=0, tool_choice="lookup_age"))
    result = Runner.run_sync(caller, "How old is Ada?", max_turns=4, run_config=RunConfig(model_provider=provider))
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"] and result.new_items[1].output == 42
    assert len(result.raw_responses) == 2 and isinstance(result.final_output, Person)

    async def streamed():  # the SDK's streamed run reads our events; a fresh provider for this event loop
        fresh = OpenAIProvider(base_url=server.url + "/v1", api_key=API_KEY)
        run = Runner.run_streamed(agent, "Who is Ada?", max_turns=4, run_config=RunConfig(model_provider=fresh))
        kinds = {event.type async for event in run.stream_events()}
        return run.final_output, kinds

    final, kinds = asyncio.run(streamed())
    assert isinstance(final, Person) and "raw_response_event" in kinds


def test_langchain_use_responses_api(server):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str, days: int) -> str:
        """The weather in a city for some days."""
        return "sunny"

    llm = ChatOpenAI(base_url=server.url + "/v1", api_key=API_KEY, model="tiny", temperature=0, max_tokens=80,
                     use_responses_api=True)
    [call] = llm.bind_tools([get_weather], tool_choice="get_weather").invoke("Weather in Paris for 2 days?").tool_calls
    assert call["name"] == "get_weather"
    jsonschema.validate(call["args"], get_weather.tool_call_schema.model_json_schema())
    assert isinstance(llm.with_structured_output(Person, method="json_schema").invoke("Describe a person."), Person)


@pytest.fixture(scope="module")
def r1_server():
    """deepseek_r1: the template opens the thinking, so all the 9M model writes (no </think>) is reasoning."""
    s = Server("--reasoning-parser", "deepseek_r1").wait_ready()
    yield s
    s.stop()


def test_reasoning_item_plain_and_streamed(r1_server):
    client = openai.OpenAI(base_url=r1_server.url + "/v1", api_key=API_KEY, max_retries=0)
    body = {"input": "Think.", "max_output_tokens": 8, "temperature": 0, "reasoning": {"effort": "low"}}
    plain = client.responses.create(model="tiny", **body)
    [item] = plain.output
    assert item.type == "reasoning" and item.content[0].text and plain.reasoning.effort == "low"
    assert 0 < plain.usage.output_tokens_details.reasoning_tokens
    events = _stream(r1_server, body)
    final = _final(events)
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == final.output[0].content[0].text == item.content[0].text
