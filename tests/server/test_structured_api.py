"""Structured outputs through the server, driven by the openai SDK as applications use it:
``chat.completions.parse`` with a Pydantic model, ``json_object``, vLLM's ``structured_outputs``
and ``guided_*`` fields; a bad grammar is a 400 naming its field, streamed or not."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest
from pydantic import BaseModel

MESSAGES = [{"role": "user", "content": "Describe a person."}]


class Person(BaseModel):
    name: str
    age: int
    likes_cats: bool


def test_sdk_parse_returns_the_pydantic_model(openai_client):
    done = openai_client.chat.completions.parse(model="tiny", messages=MESSAGES, response_format=Person,
                                                 max_completion_tokens=80, temperature=0)
    msg = done.choices[0].message
    assert isinstance(msg.parsed, Person) and msg.parsed == Person.model_validate_json(msg.content)
    assert done.choices[0].finish_reason == "stop"


def test_json_object_streamed_and_not(openai_client):
    for temperature in (0.0, 1.0):
        done = openai_client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=60,
                                                     temperature=temperature, seed=7,
                                                     response_format={"type": "json_object"})
        assert isinstance(json.loads(done.choices[0].message.content), dict)
    stream = openai_client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=60,
                                                   stream=True, response_format={"type": "json_object"})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("extra, check", [
    ({"structured_outputs": {"regex": "[0-9]{4}"}}, lambda t: re.fullmatch(r"[0-9]{4}", t)),
    ({"guided_regex": "[a-c]{3}!"}, lambda t: re.fullmatch(r"[a-c]{3}!", t)),
    ({"structured_outputs": {"choice": ["red", "green", "blue"]}}, lambda t: t in ("red", "green", "blue")),
    ({"guided_choice": ["left", "right"]}, lambda t: t in ("left", "right")),
    ({"guided_json": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}},
     lambda t: isinstance(json.loads(t)["n"], int)),
    ({"structured_outputs": {"grammar": 'root ::= "x" ("y" | "z")'}}, lambda t: t in ("xy", "xz")),
])
def test_vllm_fields_on_completions(openai_client, extra, check):
    done = openai_client.completions.create(model="tiny", prompt="Answer:", max_tokens=30,
                                            temperature=0, extra_body=extra)
    assert check(done.choices[0].text), done.choices[0].text


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("extra, field", [
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs"),
    ({"guided_grammar": "root ::= "}, "structured_outputs"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
])
def test_a_bad_grammar_is_a_400_that_names_the_field(server, extra, field, stream):
    r = httpx.post(server.url + "/v1/completions", headers=server.headers, timeout=30,
                   json={"prompt": "x", "max_tokens": 5, "stream": stream, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert field in err["message"] or err.get("param") == field, err
    ok = httpx.post(server.url + "/v1/completions", headers=server.headers, timeout=30,
                    json={"prompt": "x", "max_tokens": 3})
    assert ok.status_code == 200  # the server goes on


def test_n2_each_completion_follows_the_schema(openai_client):
    done = openai_client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=80, n=2, temperature=1.0, seed=1,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "strict": True,
                                                               "schema": Person.model_json_schema()}})
    for choice in done.choices:
        Person.model_validate_json(choice.message.content)


def test_the_sdk_sees_a_bad_schema_as_bad_request(openai_client):
    with pytest.raises(openai.BadRequestError):
        openai_client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5,
                                              response_format={"type": "json_schema", "json_schema": {
                                                  "name": "x", "schema": {"type": "objectx"}}})


def test_logit_bias_changes_the_output_through_the_sdk(openai_client):
    plain = openai_client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=5, temperature=0)
    forced = openai_client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=5, temperature=0,
                                              logit_bias={"42": 100})
    ids = openai_client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=5, temperature=0,
                                           logit_bias={"42": 100}, extra_body={"allowed_token_ids": [42, 43]})
    assert forced.choices[0].text == ids.choices[0].text != plain.choices[0].text


def test_bad_words_through_the_sdk(openai_client):
    """The built-in model says " server" early and " server" "s" later: vLLM's bad_words ban both."""
    kwargs = dict(model="tiny", prompt="Once upon a time", max_tokens=30, temperature=0)
    plain = openai_client.completions.create(**kwargs).choices[0].text
    assert " server" in plain and " servers" in plain
    one = openai_client.completions.create(**kwargs, extra_body={"bad_words": ["server"]}).choices[0].text
    two = openai_client.completions.create(**kwargs, extra_body={"bad_words": ["servers"]}).choices[0].text
    assert "server" not in one
    assert " servers" not in two and two.startswith(plain[:plain.index(" servers") + len(" server")])
    chat = openai_client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=20, temperature=0)
    words = chat.choices[0].message.content.split()[:2]
    banned = openai_client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=20, temperature=0,
                                                   extra_body={"bad_words": words})
    assert not set(words) & set(banned.choices[0].message.content.split())


@pytest.mark.parametrize("body, param", [({"logit_bias": {"abc": 1}}, "logit_bias"),
                                         ({"bad_words": ["ok", ""]}, "bad_words"),
                                         ({"bad_words": "server"}, "bad_words"),
                                         ({"logit_bias": {"1": 101}}, "logit_bias"),
                                         ({"logit_bias": {"99999999": 1}}, "logit_bias"),
                                         ({"allowed_token_ids": []}, "allowed_token_ids")])
def test_bad_token_controls_are_400s(server, body, param):
    r = httpx.post(server.url + "/v1/completions", headers=server.headers, timeout=30,
                   json={"prompt": "x", "max_tokens": 2, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_penalties_change_the_output_through_the_sdk(openai_client):
    kwargs = dict(model="tiny", prompt="The the the the", max_tokens=24, temperature=0)
    plain = openai_client.completions.create(**kwargs).choices[0].text
    for extra in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}):
        assert openai_client.completions.create(**kwargs, **extra).choices[0].text != plain
    assert openai_client.completions.create(**kwargs, extra_body={"repetition_penalty": 1.8}).choices[0].text != plain
