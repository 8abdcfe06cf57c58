"""A multimodal checkpoint served for its text model (Gemma3ForConditionalGeneration, as Gemma 3
4b-27b ship): the `openai` SDK's completions give transformers' greedy tokens; image parts in a chat
are refused naming the field; the API process reads the text section of config.json."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from models import multimodal_checkpoint
from openai import BadRequestError, OpenAI

from expresslane import LLM, SamplingParams
from expresslane.server.engine_client import EngineClient

from .conftest import API_KEY, Server


@pytest.fixture(scope="module")
def checkpoint(model_dirs, tmp_path_factory):
    return multimodal_checkpoint(model_dirs["gemma3"], tmp_path_factory.mktemp("gemma3-mm") / "model")


@pytest.fixture(scope="module")
def client(checkpoint):
    s = Server(str(checkpoint[0]), "--served-model-name", "gemma3").wait_ready()
    try:
        yield OpenAI(base_url=s.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
    finally:
        s.stop()


def test_completions_equal_transformers(client, checkpoint):
    path, hf = checkpoint
    prompt = [5, 77, 300, 12, 9]
    out = client.completions.create(model="gemma3", prompt=prompt, max_tokens=6, temperature=0,
                                    extra_body={"ignore_eos": True})
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=6, min_new_tokens=6, do_sample=False)[0, 5:]
    [offline] = LLM(str(path)).generate([{"prompt_token_ids": prompt}], SamplingParams(
        temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)  # its text: the same detokenizer
    assert offline.outputs[0].token_ids == want.tolist()
    assert out.choices[0].text == offline.outputs[0].text and out.usage.completion_tokens == 6


def test_image_parts_are_refused_naming_the_field(client):
    with pytest.raises(BadRequestError, match="messages"):
        client.chat.completions.create(model="gemma3", max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}])


def test_frontend_reads_the_text_section_and_the_engines_vocab_size(checkpoint, tmp_path):
    """The hub's config.json leaves the text model's vocab_size at its class default: the API
    process (no transformers config classes, no torch) takes the engine's."""
    path = checkpoint[0]
    config = json.loads((path / "config.json").read_text())
    del config["text_config"]["vocab_size"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    for f in path.iterdir():
        if f.name.startswith("tokenizer"):
            (tmp_path / f.name).write_bytes(f.read_bytes())
    frontend = SimpleNamespace(model_dir=tmp_path, _engine_kwargs={})
    _, vocab_size, eos, _, token_texts = EngineClient._load_frontend(frontend, 512)
    assert vocab_size == len(token_texts) == 512 and {1, 2} <= set(eos)  # the top-level eos ids
