"""Embeddings (runner pooling) equal transformers' own final hidden states pooled the same way
(float32, CPU), through chunked prefill, prefix-cache hits and preemption; the pooler config
comes from a sentence-transformers directory or the flags; each runner refuses the other's requests."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
import torch.nn.functional as F
from models import build_model

from expresslane import LLM, PoolingParams, SamplingParams

TOL = 1e-5


def make_prompts() -> list[list[int]]:
    rng = random.Random(7)
    prompts = [[rng.randrange(500) for _ in range(n)] for n in (1, 2, 15, 16, 17, 40, 100)]
    shared = [rng.randrange(500) for _ in range(70)]  # three prompts share 4 full blocks
    prompts += [shared + [rng.randrange(500) for _ in range(n)] for n in (3, 20, 33)]
    return prompts


PROMPTS = make_prompts()


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def model_dir(request, tmp_path_factory):
    return build_model(request.param, tmp_path_factory.mktemp(request.param))


def hidden_states(model_dir, ids: list[int]) -> torch.Tensor:
    """transformers' final hidden states ([T, H], after the last norm): the reference."""
    from transformers import AutoModel

    model = _BASE.get(model_dir)
    if model is None:
        model = _BASE[model_dir] = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).last_hidden_state[0]


_BASE: dict = {}


def reference(model_dir, ids: list[int], pooling: str, normalize: bool = True, dimensions: int | None = None):
    h = hidden_states(model_dir, ids)
    v = {"LAST": h[-1], "MEAN": h.mean(dim=0), "CLS": h[0]}[pooling]
    if dimensions is not None:
        v = v[:dimensions]
    return F.normalize(v, dim=-1) if normalize else v


def check(model_dir, outs, prompts, pooling: str, **kw) -> None:
    for out, ids in zip(outs, prompts):
        assert out.finished and out.prompt_token_ids == ids
        got = torch.tensor(out.outputs.embedding)
        want = reference(model_dir, ids, pooling, **kw)
        assert got.shape == want.shape
        assert torch.allclose(got, want, atol=TOL, rtol=0), f"{len(ids)} tokens: max diff {(got - want).abs().max()}"


def embed(llm: LLM, prompts, **kw):
    return llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False, **kw)


@pytest.mark.parametrize("pooling", ["LAST", "MEAN", "CLS"])
def test_chunked_prefill_and_prefix_cache(model_dir, pooling):
    # 16-token steps: every prompt longer than that is chunked
    llm = LLM(str(model_dir), runner="pooling", max_num_batched_tokens=16,
              pooler_config=json.dumps({"pooling_type": pooling}))
    outs = embed(llm, PROMPTS)
    check(model_dir, outs, PROMPTS, pooling)
    raw = embed(llm, PROMPTS, pooling_params=PoolingParams(normalize=False))  # the scale shows too
    check(model_dir, raw, PROMPTS, pooling, normalize=False)
    assert not llm.engine.has_unfinished() and llm.engine.core.kv.usage == 0.0  # no KV held after
    # the 70-token prefix's 4 blocks are cached now: new prompts behind it find them
    rng = random.Random(8)
    later = [PROMPTS[-1][:70] + [rng.randrange(500) for _ in range(n)] for n in (1, 30)]
    again = embed(llm, later)
    check(model_dir, again, later, pooling)
    hits = [o.num_cached_tokens for o in again]
    # LAST: its last token is always computed, so a hit changes nothing; MEAN and CLS need every
    # hidden state: no hit taken
    assert hits == ([64, 64] if pooling == "LAST" else [0, 0])


def test_batched_default_policy_and_a_repeat(model_dir):
    llm = LLM(str(model_dir), task="embed", max_num_batched_tokens=64)
    outs = embed(llm, PROMPTS)
    check(model_dir, outs, PROMPTS, "LAST")
    again = embed(llm, PROMPTS[-1:])  # its prefix is cached now
    assert again[0].num_cached_tokens > 0
    check(model_dir, again, PROMPTS[-1:], "LAST")


def test_preemption_recomputes_mean(model_dir):
    llm = LLM(str(model_dir), runner="pooling", pooler_config='{"pooling_type": "MEAN"}', max_num_batched_tokens=64,
              num_kv_blocks=12, max_model_len=128, scheduling_policy="fcfs")
    prompts = [p for p in PROMPTS if len(p) <= 128] * 2
    outs = embed(llm, prompts)
    assert llm.engine.core.scheduler.num_preemptions > 0
    check(model_dir, outs, prompts, "MEAN")


def test_dimensions_and_normalize(model_dir):
    llm = LLM(str(model_dir), runner="pooling")
    prompts = PROMPTS[3:6]
    params = [PoolingParams(dimensions=8), PoolingParams(normalize=False), PoolingParams(dimensions=5, normalize=False)]
    outs = embed(llm, prompts, pooling_params=params)
    for out, ids, p in zip(outs, prompts, params):
        check(model_dir, [out], [ids], "LAST", normalize=p.normalize is not False, dimensions=p.dimensions)
    assert abs(sum(x * x for x in outs[0].outputs.embedding) - 1.0) < 1e-5
    with pytest.raises(ValueError, match="dimensions"):
        embed(llm, prompts[:1], pooling_params=PoolingParams(dimensions=65))


def test_truncate_prompt_tokens_pools_the_last_tokens(model_dir):
    """vLLM's truncate_prompt_tokens, as LLM.embed's argument or a PoolingParams field: the last k
    tokens pooled as if alone; a bad value names the field."""
    llm = LLM(str(model_dir), runner="pooling")
    ids = PROMPTS[4]
    assert len(ids) > 5
    [by_arg] = embed(llm, [ids], truncate_prompt_tokens=5)
    [by_params] = embed(llm, [ids], pooling_params=PoolingParams(truncate_prompt_tokens=5))
    check(model_dir, [by_arg, by_params], [ids[-5:]] * 2, "LAST")
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        embed(llm, [ids], truncate_prompt_tokens=0)


def test_sentence_transformers_directory(model_dir, tmp_path):
    d = tmp_path / "st"
    shutil.copytree(model_dir, d)
    (d / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (d / "1_Pooling").mkdir()
    (d / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": 64, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True,
        "pooling_mode_max_tokens": False, "pooling_mode_lasttoken": False}))
    llm = LLM(str(d))  # runner auto: a sentence-transformers directory is an embedding model
    assert llm.engine.core.runner_type == "pooling"
    outs = embed(llm, PROMPTS[4:6])
    check(model_dir, outs, PROMPTS[4:6], "MEAN", normalize=False)  # no Normalize module
    # the flag goes over the directory's settings
    llm = LLM(str(d), pooler_config='{"pooling_type": "last", "normalize": true}')
    check(model_dir, embed(llm, PROMPTS[4:6]), PROMPTS[4:6], "LAST")


def test_base_model_checkpoint(model_dir, tmp_path):
    """A `*Model` checkpoint (no LM head, no `model.` prefix), as gte-style models ship: auto-detected."""
    from transformers import AutoConfig, AutoModel

    base = AutoModel.from_pretrained(model_dir, dtype=torch.float32)
    d = tmp_path / "base"
    base.save_pretrained(d)
    for f in model_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, d / f.name)
    assert AutoConfig.from_pretrained(d).architectures[0].endswith("Model")
    llm = LLM(str(d), max_num_batched_tokens=16)
    assert llm.engine.core.runner_type == "pooling"
    check(model_dir, embed(llm, PROMPTS[5:8]), PROMPTS[5:8], "LAST")


def test_each_runner_refuses_the_other(model_dir):
    gen = LLM(str(model_dir))
    with pytest.raises(ValueError, match="runner='pooling'"):
        gen.embed(["hello"])
    pool = LLM(str(model_dir), runner="pooling")
    with pytest.raises(ValueError, match="runner generate"):
        pool.generate(["hello"], SamplingParams(max_tokens=2), use_tqdm=False)
    # a pooling input may fill the whole context (nothing is generated after it)
    full = LLM(str(model_dir), runner="pooling", max_model_len=32)
    check(model_dir, embed(full, [PROMPTS[5][:32]]), [PROMPTS[5][:32]], "LAST")
    with pytest.raises(ValueError, match="33 tokens"):
        embed(full, [PROMPTS[5][:33]])


@pytest.mark.parametrize("kwargs, match", [
    (dict(runner="embed"), "runner"),
    (dict(task="pooling"), "task"),
    (dict(task="embed", runner="generate"), "disagree"),
    (dict(pooler_config='{"pooling_type": "MAX"}'), "pooling_type"),
    (dict(pooler_config='{"softmax": true}'), "unknown key"),
    (dict(override_pooler_config="[1]"), "override_pooler_config"),
])
def test_bad_config_names_the_field(kwargs, match):
    from expresslane.config import EngineConfig

    with pytest.raises(ValueError, match=match):
        EngineConfig.from_kwargs(**kwargs)


def test_triton_backend(model_dir):
    """The GPU kernels' path (Triton's interpreter on CPU, one architecture): chunked MEAN pooling."""
    pytest.importorskip("triton")
    if not model_dir.name.startswith("qwen2"):
        pytest.skip("one architecture is enough for the kernels' path (the interpreter is slow)")
    llm = LLM(str(model_dir), runner="pooling", attention_backend="triton", max_num_batched_tokens=32,
              pooler_config='{"pooling_type": "MEAN"}')
    prompts = PROMPTS[-3:]
    check(model_dir, embed(llm, prompts), prompts, "MEAN")


def test_tensor_parallel_pools_what_one_rank_does(tmp_path):
    """TP=2 over gloo: the pooled hidden states (gathered from the ranks' partial sums) equal
    transformers', chunked (one family: qwen2's biases and tied embeddings)."""
    model_dir = build_model("qwen2", tmp_path)
    llm = LLM(str(model_dir), runner="pooling", tensor_parallel_size=2, max_num_batched_tokens=16,
              pooler_config=json.dumps({"pooling_type": "MEAN"}))
    try:
        outs = embed(llm, PROMPTS)
    finally:
        llm.shutdown()
    check(model_dir, outs, PROMPTS, "MEAN")
