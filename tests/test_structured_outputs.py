"""Structured outputs in the engine (offline LLM): xgrammar's masks hold every output to its
grammar, even the built-in 9M model's, and end it before max_tokens (engine/structured_output.py)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from expresslane import LLM
from expresslane.config import StructuredOutputConfig
from expresslane.runner.sampler import apply_token_bitmask
from expresslane.sampling_params import SamplingParams, StructuredOutputs

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "ok": {"type": "boolean"}, "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "ok", "tags"], "additionalProperties": False}


@pytest.fixture(scope="module")
def llm():
    return LLM()


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, **kw)


def test_json_schema_output_parses_and_follows_the_schema(llm):
    outs = llm.generate(["The answer in JSON:", "Name, age:"], _greedy(max_tokens=120, structured_outputs=StructuredOutputs(
        json=json.dumps(SCHEMA))))
    for o in outs:
        c = o.outputs[0]
        value = json.loads(c.text)
        assert set(value) == set(SCHEMA["properties"]) and isinstance(value["age"], int)
        assert isinstance(value["ok"], bool) and all(isinstance(t, str) for t in value["tags"])
        assert c.finish_reason == "stop"


@pytest.mark.parametrize("max_tokens", [StructuredOutputConfig().json_close_tokens + 8, 200])
def test_any_json_object_closes_before_max_tokens(llm, max_tokens):
    """The 9M model left alone opens a key and never closes it; near the budget's end the output closes."""
    outs = llm.generate(["The answer in JSON:", "Tell me a story"], SamplingParams(
        temperature=1.0, seed=3, n=3, max_tokens=max_tokens, structured_outputs=StructuredOutputs(json_object=True)))
    for o in outs:
        for c in o.outputs:
            assert isinstance(json.loads(c.text), dict), c.text
            assert c.finish_reason == "stop" and len(c.token_ids) <= max_tokens


def test_regex_choice_and_grammar(llm):
    regex, choice, grammar = (StructuredOutputs(regex=r"[0-9]{3}-[a-z]{2}"), StructuredOutputs(choice=["yes", "no", "a \"quoted\" one"]),
                              StructuredOutputs(grammar='root ::= "A" | "B" "C"+'))
    outs = llm.generate(["x", "y", "z"], [_greedy(max_tokens=20, structured_outputs=s) for s in (regex, choice, grammar)])
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", outs[0].outputs[0].text)
    assert outs[1].outputs[0].text in choice.choice
    assert re.fullmatch(r"A|BC+", outs[2].outputs[0].text)


def test_a_grammar_that_allows_everything_changes_nothing(llm):
    prompts = ["The capital of France", "def fib(n):", "Once upon a time"]
    plain = llm.generate(prompts, _greedy(max_tokens=40))
    free = llm.generate(prompts, _greedy(max_tokens=40, structured_outputs=StructuredOutputs(regex=r"[\s\S]*")))
    assert [o.outputs[0].token_ids for o in free] == [o.outputs[0].token_ids for o in plain]


def test_a_grammar_that_does_not_compile_is_refused_naming_the_field(llm):
    with pytest.raises(ValueError, match="structured_outputs: the grammar does not compile"):
        llm.generate("x", _greedy(structured_outputs=StructuredOutputs(regex="a(b")))
    assert llm.generate("x", _greedy(max_tokens=3))[0].outputs[0].token_ids  # the engine goes on


def test_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputs(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputs()


def test_apply_token_bitmask_keeps_exactly_the_allowed_tokens():
    vocab = 70
    allowed = [0, 5, 31, 32, 63, 64, 69]
    bits = np.zeros(96, dtype=bool)
    bits[allowed] = True
    mask = torch.from_numpy(np.packbits(bits, bitorder="little").view("<i4").copy())[None].repeat(2, 1)
    mask[1] = -1  # a row without a constraint
    logits = torch.randn(2, vocab)
    before = logits.clone()
    apply_token_bitmask(logits, mask)
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == allowed
    assert torch.equal(logits[0, allowed], before[0, allowed]) and torch.equal(logits[1], before[1])


def test_logit_bias_and_allowed_token_ids(llm):
    plain = llm.generate("Once upon a time", _greedy(max_tokens=6))[0].outputs[0].token_ids
    forced = llm.generate("Once upon a time", _greedy(max_tokens=6, logit_bias={42: 100.0}))[0].outputs[0].token_ids
    assert forced == [42] * 6
    banned = llm.generate("Once upon a time", _greedy(max_tokens=6, logit_bias={plain[0]: -100.0}))[0].outputs[0]
    assert banned.token_ids[0] != plain[0]
    allowed = [7, 11, 13]
    outs = llm.generate("Once upon a time", SamplingParams(temperature=1.0, seed=1, n=4, max_tokens=8,
                                                           allowed_token_ids=allowed))[0].outputs
    assert all(set(c.token_ids) <= set(allowed) for c in outs)
    # a batch mixing rows with and without controls: the plain row is as alone
    mixed = llm.generate(["Once upon a time", "Once upon a time"],
                         [_greedy(max_tokens=6), _greedy(max_tokens=6, logit_bias={42: 100.0})])
    assert mixed[0].outputs[0].token_ids == plain and mixed[1].outputs[0].token_ids == [42] * 6


@pytest.mark.parametrize("end", [" server", " the server"])
def test_the_grammar_starts_after_its_end_tokens(llm, end):
    """A reasoning model's grammar waits for ``</think>`` (StructuredOutputs.after_token_ids): here the
    end is what the built-in model writes unconstrained (one token, then two): before it the output is
    the plain one, after it the schema holds."""
    plain = llm.generate("Once upon a time", _greedy(max_tokens=8))[0].outputs[0]
    ids = llm.tokenizer.encode(end, add_special_tokens=False)
    at = next(i for i in range(len(plain.token_ids)) if plain.token_ids[i:i + len(ids)] == ids) + len(ids)
    spec = StructuredOutputs(json=json.dumps(SCHEMA), after_token_ids=ids)
    out = llm.generate("Once upon a time", _greedy(max_tokens=150, structured_outputs=spec))[0].outputs[0]
    assert out.token_ids[:at] == plain.token_ids[:at]
    value = json.loads(llm.tokenizer.decode(out.token_ids[at:], skip_special_tokens=True))
    assert set(value) == set(SCHEMA["properties"]) and out.finish_reason == "stop"
