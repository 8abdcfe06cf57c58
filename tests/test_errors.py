"""Bad input raises a clear exception that names the problem."""

import json
import shutil

import pytest

from safetensors.torch import load_file, save_file

from expresslane import LLM, SamplingParams
from expresslane.config import EngineConfig


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir), max_model_len=64)


def test_prompt_longer_than_context(llm):
    with pytest.raises(ValueError, match="maximum context length is 64"):
        llm.generate([{"prompt_token_ids": [1] * 64}], use_tqdm=False)
    # the engine is still usable, and nothing was left queued
    [out] = llm.generate([{"prompt_token_ids": [1] * 10}], SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(out.outputs[0].token_ids) >= 1 and not llm.engine.has_unfinished()


def test_output_stops_at_context_limit(llm):
    [out] = llm.generate([{"prompt_token_ids": [1] * 60}], SamplingParams(max_tokens=50, ignore_eos=True),
                         use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4 and out.outputs[0].finish_reason == "length"


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_tokens=0), "max_tokens"), (dict(max_tokens=-3), "max_tokens"),
    (dict(temperature=-0.5), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"), (dict(min_p=2.0), "min_p"), (dict(n=0), "n"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens"), (dict(stop=[""]), "stop"),
])
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_prompts(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate([{"prompt_token_ids": []}], use_tqdm=False)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate([{"prompt_token_ids": [10**7]}], use_tqdm=False)
    with pytest.raises(TypeError, match="prompt"):
        llm.generate([42], use_tqdm=False)


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_num_seqs=0), "max_num_seqs"), (dict(block_size=-1), "block_size"),
    (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"), (dict(scheduling_policy="lifo"), "scheduling_policy"),
    (dict(dtype="int8"), "dtype"), (dict(num_kv_blocks=0), "num_kv_blocks"),
])
def test_bad_engine_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig.from_kwargs(**kwargs)


def test_unknown_config_field():
    with pytest.raises(TypeError, match="max_num_sequences"):
        EngineConfig.from_kwargs(max_num_sequences=4)


def test_kv_cache_smaller_than_context(llama_dir):
    with pytest.raises(ValueError, match="KV cache has 2 blocks of 16 tokens, fewer than max_model_len=64"):
        LLM(str(llama_dir), num_kv_blocks=2, max_model_len=64)


def test_max_model_len_over_model_limit(llama_dir):
    with pytest.raises(ValueError, match="larger than the model's limit"):
        LLM(str(llama_dir), max_model_len=10**6)


def test_missing_model_dir(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(str(tmp_path / "nope"))


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_unknown_architecture(llama_dir, tmp_path):
    d = _copy(llama_dir, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["FancyNewForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported architecture.*FancyNewForCausalLM"):
        LLM(str(d))


def test_broken_config_json(llama_dir, tmp_path):
    d = _copy(llama_dir, tmp_path / "m")
    (d / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="broken config.json"):
        LLM(str(d))


def test_missing_weights(llama_dir, tmp_path):
    d = _copy(llama_dir, tmp_path / "m")
    for f in d.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        LLM(str(d))


def test_truncated_weights(llama_dir, tmp_path):
    d = _copy(llama_dir, tmp_path / "m")
    [f] = d.glob("*.safetensors")
    f.write_bytes(f.read_bytes()[:1000])
    with pytest.raises(ValueError, match="cannot read weights"):
        LLM(str(d))


def test_weights_of_the_wrong_shape(llama_dir, model_dirs, tmp_path):
    d = _copy(llama_dir, tmp_path / "m")
    for f in d.glob("*.safetensors"):
        f.unlink()
    for f in model_dirs["qwen3"].glob("*.safetensors"):
        shutil.copy(f, d / f.name)
    with pytest.raises(ValueError, match="checkpoint"):
        LLM(str(d))


def test_expert_tensors_of_the_wrong_shape_or_missing(model_dirs, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(model_dirs["mixtral"], bad)
    tensors = load_file(bad / "model.safetensors")
    tensors["model.layers.1.block_sparse_moe.experts.3.w2.weight"] = tensors[
        "model.layers.1.block_sparse_moe.experts.3.w2.weight"][:, :-1].contiguous()
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"expert 3 down tensor of shape \(64, 127\); the model's is \(64, 128\)"):
        LLM(str(bad))
    del tensors["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing 1 tensors, e.g. \['layers.1.mlp#3.down'\]"):
        LLM(str(bad))
