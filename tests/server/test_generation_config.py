"""``serve --generation-config DIR``: requests that leave out temperature, top_k or max_tokens get
the generation config's (here top_k 1: greedy; 5 tokens), requests that set them keep their own."""

from __future__ import annotations

import json

import pytest
from openai import OpenAI

from .conftest import API_KEY, Server

MESSAGES = [{"role": "user", "content": "Tell me a story."}]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    folder = tmp_path_factory.mktemp("genconfig")
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.8, "top_k": 1, "max_new_tokens": 5}))
    server = Server("--generation-config", str(folder))
    try:
        server.wait_ready()
        yield OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
    finally:
        server.stop()


def test_requests_without_the_fields_get_the_generation_config(client):
    default = client.chat.completions.create(model="tiny", messages=MESSAGES, extra_body={"ignore_eos": True})
    greedy = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=5,
                                            extra_body={"ignore_eos": True})
    assert default.usage.completion_tokens == 5 and default.choices[0].finish_reason == "length"
    assert default.choices[0].message.content == greedy.choices[0].message.content  # top_k 1
    text = client.completions.create(model="tiny", prompt="Once upon a time", extra_body={"ignore_eos": True})
    assert text.usage.completion_tokens == 5


def test_requests_that_set_them_keep_their_own(client):
    greedy = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=20,
                                            extra_body={"ignore_eos": True})
    assert greedy.usage.completion_tokens == 20
    sampled = [client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=20, seed=s,
                                              extra_body={"top_k": 0, "ignore_eos": True}).choices[0].message.content
               for s in range(4)]
    assert any(s != greedy.choices[0].message.content for s in sampled)
