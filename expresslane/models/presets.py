"""Model directories with random weights at real architectures' shapes (``expresslane make-model``).

A directory looks like a Hugging Face checkpoint (config.json, generation_config.json,
tokenizer files, safetensors weights with HF names), so benchmarks and tests exercise
the real loading path without downloads. Weights are generated one tensor at a time,
each from its own generator seeded by (seed, parameter name), and streamed straight
into the safetensors file: an 8B model never sits in memory, let alone twice. The
same (preset, seed, device type) always gives identical bytes; CPU and CUDA random
streams differ. With ``quantization`` (fp8, awq, gptq) the decoder layers' projections
are written in that checkpoint format, quantized from the same float weights.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import pathlib
import shutil
import struct
import uuid
from dataclasses import dataclass

import torch

from expresslane.models import harmony
from expresslane.models.model_dir import FORMAT_VERSION, cache_dir, default_model_path
from expresslane.models.tokenizer_builder import BOS, EOS, IM_END, SPECIAL_TOKENS, save_tokenizer, special_token_ids
from expresslane.quant import checkpoint

logger = logging.getLogger(__name__)

# Bump when the bytes a (preset, seed) produces change, so stale caches are not reused.
MARKER_FILE = "expresslane-make-model.json"
MAX_SHARD_BYTES = 5 * 10**9  # transformers' default max_shard_size="5GB"
_DTYPES = {"float32": (torch.float32, "F32"), "bfloat16": (torch.bfloat16, "BF16"), "float16": (torch.float16, "F16")}
_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float8_e4m3fn: "F8_E4M3",
              torch.int32: "I32", torch.uint8: "U8"}
_BYTE_INITS = ("fp4", "e8m0")  # MXFP4 blocks (random codes) and scales (one exponent): uint8 tensors


def _config(arch: str, *, hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, vocab: int,
            max_pos: int, rope_theta: float, tied: bool, dtype: str = "bfloat16", rms_norm_eps: float = 1e-5,
            rope_scaling: dict | None = None, head_dim: int | None = None, extra: dict | None = None) -> dict:
    gpt_oss = arch == "GptOssForCausalLM"  # harmony's tokens: <|startoftext|>, and <|return|> ends a turn
    specials = special_token_ids(vocab, harmony.SPECIAL_TOKENS if gpt_oss else SPECIAL_TOKENS)
    bos, eos = (harmony.STARTOFTEXT, harmony.RETURN) if gpt_oss else (BOS, EOS)
    model_type = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "MistralForCausalLM": "mistral",
                  "MixtralForCausalLM": "mixtral", "Qwen3MoeForCausalLM": "qwen3_moe", "Gemma2ForCausalLM": "gemma2",
                  "Gemma3ForCausalLM": "gemma3_text", "Phi3ForCausalLM": "phi3", "DeepseekV2ForCausalLM": "deepseek_v2",
                  "DeepseekV3ForCausalLM": "deepseek_v3", "GptOssForCausalLM": "gpt_oss"}[arch]
    config = {
        "architectures": [arch],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim or hidden // heads,
        "hidden_act": "silu",
        "max_position_embeddings": max_pos,
        "rms_norm_eps": rms_norm_eps,
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling,
        "tie_word_embeddings": tied,
        "vocab_size": vocab,
        "bos_token_id": specials[bos],
        "eos_token_id": specials[eos],
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": dtype,  # transformers 4.x reads this name ...
        "dtype": dtype,  # ... and 5.x this one
    }
    if model_type == "llama":
        config |= {"attention_bias": False, "mlp_bias": False}
    elif model_type == "qwen2":  # Qwen2 always has q/k/v biases; no flag
        config |= {"use_sliding_window": False, "sliding_window": None, "max_window_layers": layers}
    elif model_type.startswith("gemma"):
        config |= {"hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
                   "attention_bias": False, "pad_token_id": 0}
    else:
        config |= {"sliding_window": None}
    return config | (extra or {})  # family fields: experts, windows, soft-caps


def _ramp(n: int, first: float, last: float) -> list[float]:
    """n factors growing geometrically from first to last (LongRoPE's shape of factors)."""
    return [round(first * (last / first) ** (i / (n - 1)), 4) for i in range(n)]


_MLA_DIMS = dict(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, moe_layer_freq=1)
_DEEPSEEK_YARN = {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
                  "beta_slow": 1}

PRESETS: dict[str, dict] = {
    "tiny": _config("LlamaForCausalLM", hidden=128, layers=4, heads=4, kv_heads=2, intermediate=256, vocab=2048,
                    max_pos=2048, rope_theta=10000.0, tied=False, dtype="float32"),
    "qwen2.5-0.5b": _config("Qwen2ForCausalLM", hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864,
                            vocab=151936, max_pos=32768, rope_theta=1e6, tied=True, rms_norm_eps=1e-6),
    "llama-3.2-1b": _config("LlamaForCausalLM", hidden=2048, layers=16, heads=32, kv_heads=8, intermediate=8192,
                            vocab=128256, max_pos=131072, rope_theta=500000.0, tied=True,
                            rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "llama-3-8b": _config("LlamaForCausalLM", hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336,
                          vocab=128256, max_pos=8192, rope_theta=500000.0, tied=False),
    "qwen2.5-7b": _config("Qwen2ForCausalLM", hidden=3584, layers=28, heads=28, kv_heads=4, intermediate=18944,
                          vocab=152064, max_pos=32768, rope_theta=1e6, tied=False, rms_norm_eps=1e-6),
    "mistral-7b": _config("MistralForCausalLM", hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336,
                          vocab=32768, max_pos=32768, rope_theta=1e6, tied=False),
    # Phi-3.5-mini (3.8B; LongRoPE to 128k over 4k, the factors a ramp of the real ones' length and
    # range, not the shipped values) and Phi-4 (14.7B): checkpoints with fused qkv_proj and gate_up_proj
    "phi-3.5-mini": _config("Phi3ForCausalLM", hidden=3072, layers=32, heads=32, kv_heads=32, intermediate=8192,
                            vocab=32064, max_pos=131072, rope_theta=10000.0, tied=False,
                            rope_scaling={"type": "longrope", "short_factor": _ramp(48, 1.0, 2.5),
                                          "long_factor": _ramp(48, 1.0, 60.0)},
                            extra={"original_max_position_embeddings": 4096, "sliding_window": 262144}),
    "phi-4": _config("Phi3ForCausalLM", hidden=5120, layers=40, heads=40, kv_heads=10, intermediate=17920,
                     vocab=100352, max_pos=16384, rope_theta=250000.0, tied=False,
                     extra={"original_max_position_embeddings": 16384}),
    # the first Mistral: a 4096-token sliding window on every layer
    "mistral-7b-v0.1": _config("MistralForCausalLM", hidden=4096, layers=32, heads=32, kv_heads=8,
                               intermediate=14336, vocab=32000, max_pos=32768, rope_theta=10000.0, tied=False,
                               extra={"sliding_window": 4096}),
    # mixtures of experts: 46.7B parameters (12.9B active per token), and 30.5B (3.3B active)
    "mixtral-8x7b": _config("MixtralForCausalLM", hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336,
                            vocab=32000, max_pos=32768, rope_theta=1e6, tied=False,
                            extra=dict(num_local_experts=8, num_experts_per_tok=2, router_jitter_noise=0.0,
                                       output_router_logits=False, router_aux_loss_coef=0.02)),
    "qwen3-30b-a3b": _config("Qwen3MoeForCausalLM", hidden=2048, layers=48, heads=32, kv_heads=4, head_dim=128,
                             intermediate=6144, vocab=151936, max_pos=40960, rope_theta=1e6, tied=False,
                             rms_norm_eps=1e-6,
                             extra=dict(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                                        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                                        attention_bias=False, use_sliding_window=False, max_window_layers=48,
                                        output_router_logits=False, router_aux_loss_coef=0.001)),
    # Gemma: sliding layers (every other one; Gemma 3 five of six, with their own RoPE base) and
    # global ones, soft-caps (Gemma 2), (1 + w) norms; the engine caps max_model_len at the window
    "gemma-2-9b": _config("Gemma2ForCausalLM", hidden=3584, layers=42, heads=16, kv_heads=8, head_dim=256,
                          intermediate=14336, vocab=256000, max_pos=8192, rope_theta=10000.0, tied=True,
                          rms_norm_eps=1e-6,
                          extra=dict(query_pre_attn_scalar=256, sliding_window=4096, attn_logit_softcapping=50.0,
                                     final_logit_softcapping=30.0,
                                     layer_types=["sliding_attention", "full_attention"] * 21)),
    "gemma-3-12b": _config("Gemma3ForCausalLM", hidden=3840, layers=48, heads=16, kv_heads=8, head_dim=256,
                           intermediate=15360, vocab=262208, max_pos=131072, rope_theta=1e6, tied=True,
                           rms_norm_eps=1e-6, rope_scaling={"rope_type": "linear", "factor": 8.0},
                           extra=dict(query_pre_attn_scalar=256, sliding_window=1024, rope_local_base_freq=10000.0,
                                      sliding_window_pattern=6, attn_logit_softcapping=None,
                                      final_logit_softcapping=None,
                                      layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 8)),
    # multi-head latent attention (the latent KV cache: 576 values a token and layer) and DeepSeek's MoE:
    # V2-Lite 15.7B parameters (2.4B active per token; q_proj, greedy routing), V3 671B (37B active;
    # q_lora_rank, sigmoid scores and noaux_tc group routing): V3 for --no-weights shapes
    "deepseek-v2-lite": _config("DeepseekV2ForCausalLM", hidden=2048, layers=27, heads=16, kv_heads=16, head_dim=64,
                                intermediate=10944, vocab=102400, max_pos=163840, rope_theta=10000.0, tied=False,
                                rms_norm_eps=1e-6,
                                rope_scaling=_DEEPSEEK_YARN | {"mscale": 0.707, "mscale_all_dim": 0.707},
                                extra=dict(_MLA_DIMS, q_lora_rank=None, n_routed_experts=64, n_shared_experts=2,
                                           num_experts_per_tok=6, moe_intermediate_size=1408, first_k_dense_replace=1,
                                           topk_method="greedy", n_group=1, topk_group=1, routed_scaling_factor=1.0,
                                           norm_topk_prob=False)),
    "deepseek-v3": _config("DeepseekV3ForCausalLM", hidden=7168, layers=61, heads=128, kv_heads=128, head_dim=64,
                           intermediate=18432, vocab=129280, max_pos=163840, rope_theta=10000.0, tied=False,
                           rms_norm_eps=1e-6, rope_scaling=_DEEPSEEK_YARN | {"mscale": 1.0, "mscale_all_dim": 1.0},
                           extra=dict(_MLA_DIMS, q_lora_rank=1536, n_routed_experts=256, n_shared_experts=1,
                                      num_experts_per_tok=8, moe_intermediate_size=2048, first_k_dense_replace=3,
                                      topk_method="noaux_tc", n_group=8, topk_group=4, routed_scaling_factor=2.5,
                                      norm_topk_prob=True, rope_interleave=True)),
    # gpt-oss-20b as shipped: MXFP4 experts (32, top 4), sinks, every other layer a 128-token window
    "gpt-oss-20b": _config("GptOssForCausalLM", hidden=2880, layers=24, heads=64, kv_heads=8, head_dim=64,
                           intermediate=2880, vocab=201088, max_pos=131072, rope_theta=150000.0, tied=False,
                           rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                         "truncate": False, "original_max_position_embeddings": 4096},
                           extra=dict(attention_bias=True, sliding_window=128, num_local_experts=32,
                                      num_experts_per_tok=4, swiglu_limit=7.0, router_aux_loss_coef=0.9,
                                      output_router_logits=False,
                                      layer_types=["sliding_attention", "full_attention"] * 12,
                                      quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": [
                                          "model.layers.*.self_attn", "model.layers.*.mlp.router",
                                          "model.embed_tokens", "lm_head"]})),
}


def num_experts(config: dict) -> int:
    """Experts per sparse layer (0: a dense model); Mixtral says num_local_experts, Qwen3-MoE num_experts,
    DeepSeek n_routed_experts."""
    return config.get("num_local_experts") or config.get("num_experts") or config.get("n_routed_experts") or 0


@dataclass(frozen=True, slots=True)
class ParamSpec:
    name: str
    shape: tuple[int, ...]
    init: str  # "normal" (matrices), "bias", "ones" or "zeros" (norms; Gemma's scale by 1 + w), _BYTE_INITS


def param_specs(config: dict) -> list[ParamSpec]:
    """Every saved tensor of a preset (or a config.json of the same families), in HF checkpoint
    order (a tied lm_head is not saved)."""
    if config.get("model_type") not in _FAMILIES:
        raise ValueError(f"random weights are made for model types {', '.join(_FAMILIES)}, not "
                         f"{config.get('model_type')!r}")
    if config["model_type"].startswith("deepseek"):
        from expresslane.models.deepseek import checkpoint_shapes
        return [ParamSpec(*entry) for entry in checkpoint_shapes(config)]
    if config["model_type"] == "gpt_oss":
        return _gpt_oss_specs(config)
    h, heads = config["hidden_size"], config["num_attention_heads"]
    hd = config.get("head_dim") or h // heads
    q_out, kv_out = heads * hd, (config.get("num_key_value_heads") or heads) * hd
    biased = config["model_type"] == "qwen2"
    qk_norm = config["model_type"] in ("qwen3", "qwen3_moe", "gemma3_text")
    gemma = config["model_type"].startswith("gemma")
    norm = "zeros" if gemma else "ones"  # Gemma's norms scale by (1 + w)
    fused = config["model_type"] == "phi3"  # one qkv_proj and one gate_up_proj tensor
    projections = [("qkv_proj", q_out + 2 * kv_out)] if fused else [("q_proj", q_out), ("k_proj", kv_out),
                                                                   ("v_proj", kv_out)]
    specs = [ParamSpec("model.embed_tokens.weight", (config["vocab_size"], h), "normal")]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        for proj, out in projections:
            specs.append(ParamSpec(f"{p}.self_attn.{proj}.weight", (out, h), "normal"))
            if biased:
                specs.append(ParamSpec(f"{p}.self_attn.{proj}.bias", (out,), "bias"))
        specs.append(ParamSpec(f"{p}.self_attn.o_proj.weight", (h, q_out), "normal"))
        if qk_norm:
            specs += [ParamSpec(f"{p}.self_attn.{n}.weight", (hd,), norm) for n in ("q_norm", "k_norm")]
        norms = ["input_layernorm", "post_attention_layernorm"]
        norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"] if gemma else []
        specs += _mlp_specs(config, i, p) + [ParamSpec(f"{p}.{n}.weight", (h,), norm) for n in norms]
    specs.append(ParamSpec("model.norm.weight", (h,), norm))
    if not config.get("tie_word_embeddings", False):
        specs.append(ParamSpec("lm_head.weight", (config["vocab_size"], h), "normal"))
    return specs


_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "gemma2", "gemma3_text", "phi3",
             "deepseek_v2", "deepseek_v3", "gpt_oss")



def _gpt_oss_specs(config: dict) -> list[ParamSpec]:
    """gpt-oss's checkpoint as shipped (models/gpt_oss.py): biased projections, sinks, a biased
    router, each layer's experts stacked, their weights in MXFP4 (quant/mxfp4.py)."""
    h, heads, kv_heads = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    hd, e, inter = config["head_dim"], config["num_local_experts"], config["intermediate_size"]
    specs = [ParamSpec("model.embed_tokens.weight", (config["vocab_size"], h), "normal")]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        for proj, (out, inp) in (("q_proj", (heads * hd, h)), ("k_proj", (kv_heads * hd, h)),
                                 ("v_proj", (kv_heads * hd, h)), ("o_proj", (h, heads * hd))):
            specs += [ParamSpec(f"{p}.self_attn.{proj}.weight", (out, inp), "normal"),
                      ParamSpec(f"{p}.self_attn.{proj}.bias", (out,), "bias")]
        specs += [ParamSpec(f"{p}.self_attn.sinks", (heads,), "bias"),
                  ParamSpec(f"{p}.mlp.router.weight", (e, h), "normal"),
                  ParamSpec(f"{p}.mlp.router.bias", (e,), "bias")]
        for proj, (out, inp) in (("gate_up_proj", (2 * inter, h)), ("down_proj", (h, inter))):
            specs += [ParamSpec(f"{p}.mlp.experts.{proj}_blocks", (e, out, inp // 32, 16), "fp4"),
                      ParamSpec(f"{p}.mlp.experts.{proj}_scales", (e, out, inp // 32), "e8m0"),
                      ParamSpec(f"{p}.mlp.experts.{proj}_bias", (e, out), "bias")]
        specs += [ParamSpec(f"{p}.{n}.weight", (h,), "ones") for n in ("input_layernorm", "post_attention_layernorm")]
    return specs + [ParamSpec("model.norm.weight", (h,), "ones"),
                    ParamSpec("lm_head.weight", (config["vocab_size"], h), "normal")]


def _mlp_specs(config: dict, index: int, p: str) -> list[ParamSpec]:
    """Layer `index`'s feed-forward: a dense SwiGLU, or a router and its experts (HF's per-expert names)."""
    h, experts = config["hidden_size"], num_experts(config)
    if config["model_type"] == "phi3":
        inter = config["intermediate_size"]
        return [ParamSpec(f"{p}.mlp.gate_up_proj.weight", (2 * inter, h), "normal"),
                ParamSpec(f"{p}.mlp.down_proj.weight", (h, inter), "normal")]
    if config["model_type"] == "mixtral":
        inter, names, prefix = config["intermediate_size"], ("w1", "w3", "w2"), f"{p}.block_sparse_moe"
    else:
        inter, names, prefix = config.get("moe_intermediate_size"), ("gate_proj", "up_proj", "down_proj"), f"{p}.mlp"
        step = config.get("decoder_sparse_step") or 1
        if not experts or index in (config.get("mlp_only_layers") or []) or (index + 1) % step:
            inter = config["intermediate_size"]
            return [ParamSpec(f"{p}.mlp.{n}.weight", shape, "normal")
                    for n, shape in zip(names, ((inter, h), (inter, h), (h, inter)))]
    specs = [ParamSpec(f"{prefix}.gate.weight", (experts, h), "normal")]
    for e in range(experts):
        specs += [ParamSpec(f"{prefix}.experts.{e}.{n}.weight", shape, "normal")
                  for n, shape in zip(names, ((inter, h), (inter, h), (h, inter)))]
    return specs


def dummy_weights(config: dict, seed: int = 0, device: str | torch.device = "cpu"):
    """(name, tensor) of every checkpoint tensor make-model would write for `config`, generated on
    `device` instead of read from files (``--load-format dummy``: benchmarks of shapes too big to
    write to disk); quantized as its make-model ``quantization_config`` says."""
    dtype = _DTYPES[config.get("torch_dtype") or config.get("dtype") or "bfloat16"][0]
    qc = config.get("quantization_config")
    if qc is not None and qc["quant_method"] == "mxfp4":  # (gpt-oss: its specs are the packed tensors)
        qc = None
    fmt = None if qc is None else {"compressed-tensors": "fp8"}.get(qc["quant_method"], qc["quant_method"])
    for spec in param_specs(config):
        w = _generate(spec, seed, dtype, str(device)).to(device)
        if fmt is None or not checkpoint.is_quantized(spec.name):
            yield spec.name, w
            continue
        prefix = spec.name.removesuffix("weight")
        for suffix, t in checkpoint.tensors(fmt, w, qc.get("group_size", checkpoint.GROUP_SIZE), cpu=False).items():
            yield prefix + suffix, t


def _generate(spec: ParamSpec, seed: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    """One tensor on `device`, a pure function of (seed, name) and the device's RNG."""
    if spec.init in ("ones", "zeros"):
        return (torch.ones if spec.init == "ones" else torch.zeros)(spec.shape, dtype=dtype)
    if spec.init == "e8m0":  # 2^-7: FP4 codes of up to 6 give weights of up to 0.047
        return torch.full(spec.shape, 127 - 7, dtype=torch.uint8)
    digest = hashlib.sha256(f"{seed}:{spec.name}".encode()).digest()
    gen = torch.Generator(device=device)
    gen.manual_seed(int.from_bytes(digest[:8], "little") >> 1)  # manual_seed wants < 2**63
    if spec.init == "fp4":  # any byte is two valid codes
        return torch.randint(0, 256, spec.shape, dtype=torch.uint8, device=device, generator=gen)
    std = 0.02 if spec.init == "normal" else 0.01
    return torch.empty(spec.shape, dtype=dtype, device=device).normal_(0.0, std, generator=gen)


def _entries(spec: ParamSpec, dtype: torch.dtype, quantization: str | None) -> list[tuple[str, torch.dtype, tuple]]:
    """The checkpoint tensors (name, dtype, shape) that one parameter becomes."""
    if spec.init in _BYTE_INITS:
        return [(spec.name, torch.uint8, spec.shape)]
    if quantization is None or not checkpoint.is_quantized(spec.name):
        return [(spec.name, dtype, spec.shape)]
    prefix = spec.name.removesuffix("weight")
    return [(prefix + suffix, dt, shape) for suffix, dt, shape in checkpoint.plan(quantization, spec.shape, dtype)]


def _tensors(spec: ParamSpec, seed: int, dtype: torch.dtype, device: str, quantization: str | None):
    """The tensors of `_entries`, in order, on the CPU (quantized on `device` from the same float weights)."""
    w = _generate(spec, seed, dtype, device)
    if quantization is None or not checkpoint.is_quantized(spec.name):
        return [w.cpu()]
    return list(checkpoint.tensors(quantization, w).values())


def _nbytes(entries) -> int:
    return sum(dt.itemsize * math.prod(shape) for _, dt, shape in entries)


def _plan_shards(specs: list[ParamSpec], entries: dict[str, list]) -> list[list[ParamSpec]]:
    """Greedy split in checkpoint order into shards of at most MAX_SHARD_BYTES (one huge tensor may exceed it)."""
    shards: list[list[ParamSpec]] = [[]]
    size = 0
    for spec in specs:
        nbytes = _nbytes(entries[spec.name])
        if shards[-1] and size + nbytes > MAX_SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nbytes
    return shards


def _write_safetensors(path: pathlib.Path, specs: list[ParamSpec], entries: dict[str, list], seed: int,
                       dtype: torch.dtype, device: str, quantization: str | None) -> None:
    """Stream tensors into one safetensors file: header first (sizes are known), then data."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for spec in specs:
        for name, dt, shape in entries[spec.name]:
            nbytes = dt.itemsize * math.prod(shape)
            header[name] = {"dtype": _ST_DTYPES[dt], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)  # data must start 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header_bytes)) + header_bytes)
        for spec in specs:
            for (name, dt, shape), t in zip(entries[spec.name], _tensors(spec, seed, dtype, device, quantization),
                                            strict=True):
                if t.dtype != dt or tuple(t.shape) != tuple(shape):
                    raise RuntimeError(f"{name}: made {t.dtype} {tuple(t.shape)}, planned {dt} {tuple(shape)}")
                f.write(t.contiguous().view(torch.uint8).numpy().data)


def _write_weights(out_dir: pathlib.Path, config: dict, seed: int, device: str, quantization: str | None) -> None:
    dtype = _DTYPES[config["torch_dtype"]][0]
    specs = param_specs(config)
    entries = {spec.name: _entries(spec, dtype, quantization) for spec in specs}
    shards = _plan_shards(specs, entries)
    if len(shards) == 1:
        _write_safetensors(out_dir / "model.safetensors", specs, entries, seed, dtype, device, quantization)
        return
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        logger.info("writing %s (%d tensors)", name, len(shard))
        _write_safetensors(out_dir / name, shard, entries, seed, dtype, device, quantization)
        weight_map |= {entry[0]: name for spec in shard for entry in entries[spec.name]}
    total = sum(_nbytes(e) for e in entries.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _write_json(path: pathlib.Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def _build(out_dir: pathlib.Path, preset: str, seed: int, device: str, quantization: str | None,
           weights: bool) -> None:
    config = PRESETS[preset]
    if quantization is not None:
        config = {**config, "quantization_config": checkpoint.quantization_config(quantization)}
    gpt_oss = config["model_type"] == "gpt_oss"
    specials = special_token_ids(config["vocab_size"], harmony.SPECIAL_TOKENS if gpt_oss else SPECIAL_TOKENS)
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json", {
        "bos_token_id": config["bos_token_id"],  # the ends of text and of a chat turn (harmony: a turn or a call)
        "eos_token_id": [specials[t] for t in (harmony.STOP_TOKENS if gpt_oss else (EOS, IM_END))],
    })
    save_tokenizer(config["vocab_size"], out_dir, config["max_position_embeddings"], harmony=gpt_oss)
    if weights:
        _write_weights(out_dir, config, seed, device, quantization)
    # Written last: its presence means the directory is complete.
    _write_json(out_dir / MARKER_FILE, _marker(preset, seed, quantization, weights))


def _marker(preset: str, seed: int, quantization: str | None = None, weights: bool = True) -> dict:
    marker = {"preset": preset, "seed": seed, "format_version": FORMAT_VERSION}
    if quantization is not None:
        marker["quantization"] = quantization
    return marker if weights else {**marker, "weights": False}


def _existing(out_dir: pathlib.Path, preset: str, seed: int, quantization: str | None = None,
              weights: bool = True) -> bool:
    """True if out_dir already holds this model; False if absent or empty; raises if it holds anything else."""
    if not out_dir.exists() or (out_dir.is_dir() and not any(out_dir.iterdir())):
        return False
    marker = out_dir / MARKER_FILE
    found = json.loads(marker.read_text()) if marker.is_file() else None
    if found == _marker(preset, seed, quantization, weights):
        return True
    raise FileExistsError(f"{out_dir} is not empty and holds {found or 'something not made by make-model'}, "
                          f"not {_marker(preset, seed, quantization, weights)}; remove it or choose another "
                          "directory")


def make_model(preset: str, out_dir: str | os.PathLike, seed: int = 0, device: str = "cpu",
               quantization: str | None = None, weights: bool = True) -> pathlib.Path:
    """Write a random-weight model directory for ``preset`` and return its path.

    ``weights=False`` writes the config and tokenizer only: the engine then generates the same
    weights on its device (``load_format="dummy"``), for shapes too big to write to disk.

    Idempotent: a directory already made with the same preset, seed and quantization is returned as is.
    Built in a temporary sibling directory and renamed into place, so a crash leaves no
    half-written model and concurrent builders of the same directory both succeed.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of: {', '.join(PRESETS)}")
    out_dir = pathlib.Path(out_dir).expanduser().absolute()
    if quantization is not None and quantization not in checkpoint.FORMATS:
        raise ValueError(f"unknown quantization {quantization!r}; choose one of: {', '.join(checkpoint.FORMATS)}")
    if quantization == "fp8" and num_experts(PRESETS[preset]):
        raise ValueError(f"fp8 mixture-of-experts presets ({preset}) are not supported; awq and gptq are")
    if quantization is not None and PRESETS[preset]["model_type"].startswith("deepseek"):
        raise ValueError(f"quantized DeepSeek presets ({preset}) are not supported")
    if quantization is not None and PRESETS[preset]["model_type"] == "gpt_oss":
        raise ValueError(f"{preset} is written as shipped (MXFP4 experts); it takes no --quantization")
    if quantization is not None and PRESETS[preset]["model_type"] == "phi3":
        raise ValueError(f"quantized presets of fused-projection checkpoints ({preset}) are not supported")
    if _existing(out_dir, preset, seed, quantization, weights):
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{uuid.uuid4().hex}"
    tmp.mkdir()  # not tempfile.mkdtemp: its mode 0700 would survive the rename
    try:
        _build(tmp, preset, seed, device, quantization, weights)
        try:
            os.rename(tmp, out_dir)  # atomic; replaces out_dir only if it is an empty directory
        except OSError:
            if not _existing(out_dir, preset, seed, quantization, weights):  # fine if a concurrent builder got there first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def default_model_dir() -> pathlib.Path:
    """The built-in default model (shipped with the package; model_dir.DEFAULT_MODEL)."""
    return default_model_path()


def tiny_model_dir() -> pathlib.Path:
    """The ``tiny`` random preset, built into the cache on first use (fast shapes for tests and benchmarks)."""
    return make_model("tiny", cache_dir() / f"tiny-seed0-v{FORMAT_VERSION}")
