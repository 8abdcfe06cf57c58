"""RoPE scaling (layers/rotary.py) against transformers' own rotary modules: every supported kind's
cos|sin rows, token by token, for a prompt prefilled in one call and then decoded one token a
call (how transformers' generate drives a fresh module), under, at and over the length where
dynamic and longrope change frequencies; the prefix cache's length classes; the errors."""

import json
import shutil
from types import SimpleNamespace

import pytest
import torch
import transformers

from expresslane.contract import EngineCoreRequest
from expresslane.layers.rotary import (SUPPORTED_ROPE_TYPES, RotaryEmbedding, length_class, rope_context_limit,
                                       rope_frequencies, rope_type)
from expresslane.sampling_params import SamplingParams
from expresslane.scheduler.kv_cache import KVCacheManager
from expresslane.scheduler.request import Request

_SMALL = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64, num_hidden_layers=1,
              vocab_size=64, pad_token_id=None, bos_token_id=1, eos_token_id=2)
_LONGROPE = {"short_factor": [1.0, 1.1, 1.25, 1.5], "long_factor": [1.0, 2.0, 4.0, 8.0]}
# (transformers config class, its arguments, the length past which frequencies change: 0 = never)
CONFIGS = {
    "default": ("LlamaConfig", dict(max_position_embeddings=256), 0),
    "linear": ("LlamaConfig", dict(max_position_embeddings=128, rope_scaling={"rope_type": "linear", "factor": 2.0}),
               0),
    "dynamic": ("LlamaConfig", dict(max_position_embeddings=64, rope_scaling={"rope_type": "dynamic", "factor": 4.0}),
                64),
    "yarn": ("Qwen2Config", dict(max_position_embeddings=256, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}), 0),
    "llama3": ("LlamaConfig", dict(max_position_embeddings=256, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}), 0),
    # Phi-3: half of each head rotated; "su" is longrope's old name
    "longrope": ("Phi3Config", dict(max_position_embeddings=256, original_max_position_embeddings=64,
                                    partial_rotary_factor=0.5, rope_scaling={"type": "longrope", **_LONGROPE}), 64),
    "su": ("Phi3Config", dict(max_position_embeddings=256, original_max_position_embeddings=64,
                              partial_rotary_factor=0.5, rope_scaling={"type": "su", **_LONGROPE}), 64),
}


def _hf(kind: str):
    """(config, a fresh transformers rotary module of that model)."""
    name, kwargs, _ = CONFIGS[kind]
    config = getattr(transformers, name)(**_SMALL, **kwargs)
    torch.manual_seed(0)
    model = getattr(transformers, name.replace("Config", "ForCausalLM"))(config)
    return config, model.model.rotary_emb


def _hf_rows(module, positions: list[int]) -> torch.Tensor:
    """One forward call's cos | sin rows [T, rotary_dim] (transformers repeats each half)."""
    cos, sin = module(torch.zeros(1), torch.tensor([positions]))
    half = cos.shape[-1] // 2
    return torch.cat([cos[0, :, :half], sin[0, :, :half]], dim=-1)


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_rows_equal_transformers_prefill_then_decode(kind):
    _, _, threshold = CONFIGS[kind]
    edge = threshold or 64
    for prompt_len in (edge - 20, edge, edge + 25):  # under, at, over; decoding crosses the edge from under it
        config, module = _hf(kind)  # fresh: transformers' dynamic module remembers the longest length it saw
        head_dim = config.hidden_size // config.num_attention_heads
        limit = rope_context_limit(config)
        rotary = RotaryEmbedding(head_dim, limit, freqs=rope_frequencies(config, head_dim, limit))
        assert rotary.length_dependent == bool(threshold)
        calls = [list(range(prompt_len))] + [[p] for p in range(prompt_len, prompt_len + 30)]
        for positions in calls:
            expected = _hf_rows(module, positions)
            pos = torch.tensor(positions)
            table, rows = rotary.lookup(pos, torch.full_like(pos, prompt_len))
            assert table[rows].shape == expected.shape
            assert torch.equal(table[rows], expected), (prompt_len, positions[0], len(positions))


def test_rotation_of_partial_rotary_heads_equals_transformers():
    config, module = _hf("longrope")
    head_dim = config.hidden_size // config.num_attention_heads
    rotary = RotaryEmbedding(head_dim, 256, freqs=rope_frequencies(config, head_dim, 256))
    assert rotary.rotary_dim == head_dim // 2
    torch.manual_seed(1)
    q, k = torch.randn(100, 4, head_dim), torch.randn(100, 2, head_dim)
    pos = torch.arange(100)
    cos, sin = module(q, pos[None])
    q_ref, k_ref = transformers.models.phi3.modeling_phi3.apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    q_out, k_out = rotary(pos, q, k, torch.full_like(pos, 100))
    assert torch.equal(q_out, q_ref[0].transpose(0, 1)) and torch.equal(k_out, k_ref[0].transpose(0, 1))


def test_length_classes():
    dynamic, longrope = _hf("dynamic")[0], _hf("longrope")[0]
    assert [length_class(dynamic)(n) for n in (1, 64, 65, 300)] == [0, 0, 65, 300]
    assert [length_class(longrope)(n) for n in (1, 64, 65, 300)] == [0, 0, 1, 1]
    assert length_class(_hf("yarn")[0]) is None and length_class(_hf("default")[0]) is None
    assert rope_context_limit(dynamic) == 256 and rope_context_limit(_hf("yarn")[0]) == 256
    assert rope_context_limit(longrope) == 256 and rope_context_limit(_hf("linear")[0]) == 256


def _request(rid: str, prompt: list[int]) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=4)
    return Request.from_core_request(EngineCoreRequest(rid, prompt, params, (0,), 0.0), 4096)


def test_prefix_cache_hits_only_within_a_length_class():
    """Blocks computed for a prompt of one class are never another class's hit (its tokens rotate
    otherwise); within a class, a shared prefix hits as always."""
    kv = KVCacheManager(64, 4, True, length_class=lambda n: int(n > 10))
    shared = list(range(1, 9))
    short = _request("short", shared + [20])
    assert kv.allocate_slots(short, short.num_tokens)
    assert len(kv.find_cached_prefix(_request("short2", shared + [30]))) == 2
    assert kv.find_cached_prefix(_request("long", shared + list(range(40, 50)))) == []
    long = _request("long2", shared + list(range(50, 60)))
    assert kv.allocate_slots(long, long.num_tokens)
    assert len(kv.find_cached_prefix(_request("long3", shared + list(range(60, 70))))) == 2
    plain = KVCacheManager(64, 4, True)  # no classes: the prefix hits whatever the length
    assert plain.allocate_slots(short, short.num_tokens)
    assert len(plain.find_cached_prefix(_request("long", shared + list(range(40, 50))))) == 2


def test_unsupported_rope_type_is_named_with_the_supported_ones(llama_dir, tmp_path):
    from expresslane import LLM

    with pytest.raises(ValueError, match=r"unsupported rope scaling type 'mrope'.*supported: default, linear, dynamic"):
        rope_type(SimpleNamespace(rope_parameters={"rope_type": "mrope", "rope_theta": 1e4}))
    d = tmp_path / "m"
    shutil.copytree(llama_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    for key in ("rope_scaling", "rope_parameters"):
        if cfg.get(key):
            cfg[key] = {**cfg[key], "rope_type": "fancy"}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported rope scaling type 'fancy'.*" + ", ".join(SUPPORTED_ROPE_TYPES)):
        LLM(str(d))


def test_fused_checkpoint_tensor_of_the_wrong_size_is_named(model_dirs, tmp_path):
    from safetensors.torch import load_file, save_file

    from expresslane import LLM

    d = tmp_path / "m"
    shutil.copytree(model_dirs["phi3"], d)
    weights = load_file(d / "model.safetensors")
    name = "model.layers.1.self_attn.qkv_proj.weight"
    weights[name] = weights[name][:-16]
    save_file(weights, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"{name}.* 112 rows; the config gives 64 \+ 32 \+ 32"):
        LLM(str(d))


def test_longrope_request_restarts_once_past_its_threshold():
    """A short-class request whose next token sits at the threshold is recomputed from its first
    token in the long class (not counted as a preemption), once; the runner is told to forget its
    row and gets the sequence's length as its RoPE length."""
    from expresslane.config import SchedulerConfig
    from expresslane.scheduler.scheduler import Scheduler

    kv = KVCacheManager(64, 4, True, length_class=lambda n: int(n > 8))
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, scheduling_policy="fcfs")
    sched = Scheduler(config, kv, clock=lambda: 0.0, rope_restart_at=8)
    sched.add_request(_request("a", list(range(1, 7))))  # 6 prompt tokens, 4 to generate
    steps = []
    while sched.has_unfinished():
        plan = sched.schedule()
        sched.update(plan, {s.request_id: 7 for s in plan.seqs if s.sample})
        steps.append((plan.preempted_request_ids, [(n.rope_length, n.num_prompt_tokens) for n in plan.new_requests],
                      [(s.start_pos, len(s.token_ids)) for s in plan.seqs]))
    assert steps == [([], [(6, 6)], [(0, 6)]), ([], [], [(6, 1)]), ([], [], [(7, 1)]),
                     (["a"], [(9, 6)], [(0, 9)])]
    assert sched.num_preemptions == 0 and kv.num_held_blocks() == 0


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_tables_are_built_on_the_models_device(kind):
    """The runner builds the model under a device context (CUDA on a GPU); transformers computes
    scaled frequencies on the CPU: the tables follow the context's device (meta here stands for CUDA)."""
    name, kwargs, _ = CONFIGS[kind]
    hf_config = getattr(transformers, name)(**_SMALL, **kwargs)
    head_dim = hf_config.hidden_size // hf_config.num_attention_heads
    freqs = rope_frequencies(hf_config, head_dim, 64)  # on the CPU
    with torch.device("meta"):
        rotary = RotaryEmbedding(head_dim, 64, freqs=freqs)
    assert {b.device.type for b in rotary.buffers()} == {"meta"}
