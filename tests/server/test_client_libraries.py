"""Real client libraries against a real server on the built-in model, as applications use them:
LangChain (bind_tools, with_structured_output by json_schema and by function calling), instructor
(TOOLS and JSON_SCHEMA modes), the OpenAI Agents SDK (a function tool and an output_type, on the
chat completions model) and pydantic-ai (an output_type). Each must return a well-formed,
schema-valid result: the grammar holds even the 9M model to it."""

from __future__ import annotations

import pytest
from pydantic import BaseModel

from .conftest import API_KEY

MAX_TOKENS = 80


class Person(BaseModel):
    name: str
    age: int


def test_langchain_bind_tools_and_structured_output(server):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str, days: int) -> str:
        """The weather in a city for some days."""
        return "sunny"

    llm = ChatOpenAI(base_url=server.url + "/v1", api_key=API_KEY, model="tiny", temperature=0, max_tokens=MAX_TOKENS)
    msg = llm.bind_tools([get_weather], tool_choice="get_weather").invoke("Weather in Paris for 2 days?")
    [call] = msg.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str) and isinstance(call["args"]["days"], int)
    for method in ("json_schema", "function_calling"):
        person = llm.with_structured_output(Person, method=method).invoke("Describe a person.")
        assert isinstance(person, Person)


@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_instructor_modes(server, mode):
    import instructor
    from openai import OpenAI

    client = instructor.from_openai(OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0),
                                    mode=getattr(instructor.Mode, mode))
    person = client.chat.completions.create(model="tiny", response_model=Person, max_tokens=MAX_TOKENS, temperature=0,
                                            max_retries=0, messages=[{"role": "user", "content": "Describe a person."}])
    assert isinstance(person, Person)


def test_openai_agents_sdk_agent_with_a_tool_and_an_output_type(server):
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # no trace upload to OpenAI

    @function_tool
    def lookup_age(name: str) -> int:
        """How old someone is."""
        return 42

    model = OpenAIChatCompletionsModel(model="tiny", openai_client=AsyncOpenAI(base_url=server.url + "/v1",
                                                                               api_key=API_KEY, max_retries=0))
    agent = Agent(name="people", instructions="Describe a person.", model=model, tools=[lookup_age],
                  output_type=Person, model_settings=ModelSettings(max_tokens=MAX_TOKENS, temperature=0))
    result = Runner.run_sync(agent, "Who is Ada?", max_turns=4)
    assert isinstance(result.final_output, Person)


def test_pydantic_ai_output_type(server):
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel("tiny", provider=OpenAIProvider(base_url=server.url + "/v1", api_key=API_KEY))
    agent = Agent(model, output_type=Person, model_settings={"max_tokens": MAX_TOKENS, "temperature": 0})
    assert isinstance(agent.run_sync("Describe a person.").output, Person)
