"""`protocol.parse` (msgspec decode, then pydantic in strict Python mode, lists failing fast)
accepts and refuses exactly what pydantic's own strict JSON validation of the same models
does, and names the same field: the request models stay the one schema."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from expresslane.server.errors import APIError
from expresslane.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    GenerateRequest,
    TokenizeRequest,
    _is_union_tag,
    _param,
    parse,
    validation_error,
)

MODELS = (CompletionRequest, ChatCompletionRequest, GenerateRequest, TokenizeRequest, DetokenizeRequest)


def reference(model, raw: bytes):
    """pydantic's strict JSON validation, then the same extras rule: (accepted, the params it may name).

    A body with several errors may be refused for any of them: which one pydantic lists first
    differs between its versions (CI saw the extra field of `{"content": 7, "x": 1}` first)."""
    try:
        model.model_validate_json(raw)
    except ValidationError as e:
        errs = e.errors()
        if errs[0]["type"] == "json_invalid" or not errs[0]["loc"]:  # not JSON, or not an object
            return False, {None}
        named = {validation_error(e).param}
        for err in errs:
            loc = err["loc"]
            k = next((i for i, item in enumerate(loc) if _is_union_tag(item)), len(loc))
            named |= {_param(loc), _param(loc[:k])}  # a union is named by its own field
        return False, named
    try:
        parse(model, raw)  # the extras (unknown or vLLM no-op fields) are judged after validation either way
    except APIError as e:
        return False, {e.param}
    return True, {None}


def ours(model, raw: bytes):
    try:
        parse(model, raw)
    except APIError as e:
        assert e.status == 400
        return False, e.param
    return True, None


def agree(model, raw: bytes) -> None:
    accepted, param = ours(model, raw)
    ref_accepted, ref_named = reference(model, raw)
    assert accepted == ref_accepted and param in ref_named, (raw[:300], param, ref_named)


MSG = [{"role": "user", "content": "hi"}]
BODIES = [
    (CompletionRequest, {"prompt": "x"}), (CompletionRequest, {"prompt": [1, 2]}),
    (CompletionRequest, {"prompt": [[1], [2, 3]]}), (CompletionRequest, {"prompt": ["a", "b"]}),
    (CompletionRequest, {"prompt": ["a", 1]}), (CompletionRequest, {"prompt": [[1], "a"]}),
    (CompletionRequest, {"prompt": [[1], []]}), (CompletionRequest, {"prompt": []}), (CompletionRequest, {}),
    (CompletionRequest, {"prompt": 5}), (CompletionRequest, {"prompt": True}), (CompletionRequest, {"prompt": 1.5}),
    (CompletionRequest, {"prompt": [{"a": 1}]}), (CompletionRequest, {"prompt": [[1.5]]}),
    (CompletionRequest, {"prompt": "x", "max_tokens": 1.0}), (CompletionRequest, {"prompt": "x", "max_tokens": True}),
    (CompletionRequest, {"prompt": "x", "max_tokens": 10**30}), (CompletionRequest, {"prompt": "x", "n": 0}),
    (CompletionRequest, {"prompt": "x", "temperature": 1}), (CompletionRequest, {"prompt": "x", "temperature": "1"}),
    (CompletionRequest, {"prompt": "x", "temperature": True}), (CompletionRequest, {"prompt": "x", "top_p": 0}),
    (CompletionRequest, {"prompt": "x", "seed": 2**64}), (CompletionRequest, {"prompt": "x", "seed": -(2**63)}),
    (CompletionRequest, {"prompt": "x", "stop": ""}), (CompletionRequest, {"prompt": "x", "stop": ["a", ""]}),
    (CompletionRequest, {"prompt": "x", "stop": [1]}), (CompletionRequest, {"prompt": "x", "stop_token_ids": [1, -1]}),
    (CompletionRequest, {"prompt": "x", "stop_token_ids": "7"}), (CompletionRequest, {"prompt": "x", "lane": "fast"}),
    (CompletionRequest, {"prompt": "x", "stream_options": {"include_usage": "yes"}}),
    (CompletionRequest, {"prompt": "x", "stream_options": {"x": 1}}),
    (CompletionRequest, {"prompt": "x", "presence_penalty": 0.5}), (CompletionRequest, {"prompt": "x", "echo": True}),
    (CompletionRequest, {"prompt": "x", "best_of": 2}), (CompletionRequest, {"prompt": "x", "n": 2, "best_of": 2}),
    (CompletionRequest, {"prompt": "x", "logit_bias": {"1": 1}}), (CompletionRequest, {"prompt": "x", "frob": 1}),
    (CompletionRequest, {"prompt": "x", "use_beam_search": False}), (CompletionRequest, {"prompt": "x", "user": {}}),
    (ChatCompletionRequest, {"messages": MSG}), (ChatCompletionRequest, {"messages": []}),
    (ChatCompletionRequest, {"messages": "hi"}), (ChatCompletionRequest, {"messages": [{"content": "x"}]}),
    (ChatCompletionRequest, {"messages": [{"role": "wizard"}]}),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}]}),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": 7, "x": 1}]}),
    (ChatCompletionRequest, {"messages": MSG, "logprobs": 5}), (ChatCompletionRequest, {"messages": MSG, "tools": []}),
    (ChatCompletionRequest, {"messages": MSG, "response_format": {"type": "json_object"}}),
    (GenerateRequest, {"prompt": ""}), (GenerateRequest, {"prompt": [[1]]}), (GenerateRequest, {"prompt": [1], "n": 2}),
    (TokenizeRequest, {"prompt": 5}), (TokenizeRequest, {"messages": MSG}), (DetokenizeRequest, {"tokens": ["a"]}),
    (DetokenizeRequest, {"tokens": [2**70]}), (DetokenizeRequest, {}),
]


@pytest.mark.parametrize("model,body", BODIES, ids=[f"{m.__name__}-{i}" for i, (m, _) in enumerate(BODIES)])
def test_parse_agrees_with_pydantic_json_validation(model, body):
    agree(model, json.dumps(body).encode())


@pytest.mark.parametrize("raw", [b'{"prompt": "x",', b"", b"null", b"[1]", b'"x"', b"{\xff}", b'{"prompt": "x"} z',
                                 b'{"prompt": "x", "temperature": NaN}', b"[" * 100_000 + b"]" * 100_000])
def test_a_body_that_is_not_a_json_object_is_a_400_naming_no_field(raw):
    assert ours(CompletionRequest, raw) == (False, None)


json_values = st.recursive(st.none() | st.booleans() | st.integers(-(2**65), 2**65) | st.floats(allow_nan=False,
                           allow_infinity=False) | st.text(max_size=3),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner,
                                                                                       max_size=3), max_leaves=8)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_parse_agrees_on_generated_bodies(data):
    model = data.draw(st.sampled_from(MODELS))
    fields = list(model.model_fields)
    good = {"prompt": data.draw(st.sampled_from(["x", [1], [[1]], ["a"]])), "messages": MSG, "tokens": [1]}
    body = {k: v for k, v in good.items() if k in fields and data.draw(st.booleans())}
    for name in data.draw(st.lists(st.sampled_from(fields + ["messages", "frob"]), max_size=3)):
        body[name] = data.draw(json_values)
    agree(model, json.dumps(body).encode())


def test_a_huge_wrong_list_fails_at_its_first_item():
    """A 4-million-item list of wrong items is one error, not 4 million (pydantic collects every
    one by default: seconds of event loop for a 16 MiB body)."""
    raw = b'{"prompt": [1], "stop_token_ids": [' + b"0.5," * 4_000_000 + b'0]}'
    with pytest.raises(APIError) as e:
        parse(CompletionRequest, raw)
    assert e.value.param == "stop_token_ids[0]"
    raw = b'{"messages": [' + b"{}," * 1_000_000 + b"{}]}"
    with pytest.raises(APIError) as e:
        parse(ChatCompletionRequest, raw)
    assert e.value.param == "messages[0].role"
