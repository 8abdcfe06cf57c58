"""``--generation-config``: the model's generation_config.json sampling defaults, as vLLM applies
them: to the fields a request leaves out (engine/generation_config.py); ``vllm``/``none`` ignore it."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from expresslane import LLM, SamplingParams
from expresslane.engine.generation_config import sampling_defaults
from expresslane.models.presets import default_model_dir
from expresslane.server.protocol import ChatCompletionRequest, CompletionRequest, parse

GEN = {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "max_new_tokens": 7, "do_sample": True, "eos_token_id": 2}
DEFAULTS = {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "max_tokens": 7}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """The built-in model's files, with a generation_config.json that sets sampling defaults."""
    out = tmp_path_factory.mktemp("genconfig-model")
    for f in default_model_dir().iterdir():
        if f.name != "generation_config.json":
            (out / f.name).symlink_to(f)
    original = json.loads((default_model_dir() / "generation_config.json").read_text())
    (out / "generation_config.json").write_text(json.dumps({**original, **GEN}))
    return out


def test_auto_reads_the_sampling_fields_and_logs_them(model_dir, caplog):
    with caplog.at_level(logging.INFO, logger="expresslane.engine.generation_config"):
        assert sampling_defaults("auto", model_dir) == DEFAULTS
    assert "'temperature': 0.6" in caplog.text
    assert sampling_defaults("vllm", model_dir) == sampling_defaults("none", model_dir) == {}
    assert sampling_defaults("auto", default_model_dir()) == {}  # eos and bos only: nothing to default
    assert sampling_defaults(str(model_dir), default_model_dir()) == DEFAULTS  # a directory of its own
    with pytest.raises(ValueError, match="generation_config"):
        LLM(generation_config="/nonexistent-dir")


def test_a_request_gets_the_defaults_it_leaves_out():
    chat = parse(ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}], "top_k": 5})
    sp = chat.sampling_params(chat.max_completion_tokens or chat.max_tokens, None, defaults=DEFAULTS)
    assert (sp.temperature, sp.top_k, sp.top_p, sp.min_p, sp.max_tokens) == (0.6, 5, 0.95, 0.0, 7)
    own = parse(ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}], "temperature": 1.0,
                                        "top_p": 1.0, "max_completion_tokens": 30})
    sp = own.sampling_params(own.max_completion_tokens or own.max_tokens, None, defaults=DEFAULTS)
    assert (sp.temperature, sp.top_k, sp.top_p, sp.max_tokens) == (1.0, 20, 1.0, 30)
    comp = parse(CompletionRequest, {"prompt": "x"})  # OpenAI's 16 for completions, or the config's if smaller
    assert comp.sampling_params(comp.max_tokens, None, defaults=DEFAULTS).max_tokens == 7
    assert comp.sampling_params(comp.max_tokens, None, defaults={"max_tokens": 100}).max_tokens == 16
    assert comp.sampling_params(comp.max_tokens, None).temperature == 1.0


@pytest.mark.parametrize("choice, expected", [("auto", DEFAULTS), ("none", {}), ("vllm", {})])
def test_the_engine_sees_the_defaults(model_dir, choice, expected):
    llm = LLM(str(model_dir), generation_config=choice)
    seen: list[SamplingParams] = []
    add = llm.engine.core.add_request
    llm.engine.core.add_request = lambda req: (seen.append(req.sampling_params), add(req))[1]
    out = llm.generate("Once upon a time", use_tqdm=False)[0].outputs[0]
    ours = SamplingParams()
    want = {name: expected.get(name, getattr(ours, name)) for name in ("temperature", "top_k", "top_p", "max_tokens")}
    assert {name: getattr(seen[0], name) for name in want} == want
    assert len(out.token_ids) <= want["max_tokens"]
    llm.generate("Once upon a time", SamplingParams(temperature=0.0, max_tokens=9), use_tqdm=False)
    assert (seen[1].temperature, seen[1].top_k, seen[1].max_tokens) == (0.0, 0, 9)  # explicit params: as given
