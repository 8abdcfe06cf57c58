"""DeepSeek-V2, V2-Lite and V3: the Llama-family model (models/llama.py: embedding, norms, LM
head, weight loader, tensor parallelism) with multi-head latent attention and DeepSeek's
mixture of experts, as transformers computes them:

    attention  q = q_proj(x) (q_lora_rank None: V2-Lite) or q_b_proj(norm(q_a_proj(x)));
               c_kv | k_pe = kv_a_proj_with_mqa(x), c_kv normalised; per head k_nope | v =
               kv_b_proj(c_kv); RoPE on q_pe and k_pe only (one k_pe for all heads); scale
               (qk_nope + qk_rope) ** -0.5, times YaRN's mscale(mscale_all_dim) ** 2
    cache      the latent c_kv | k_pe, kv_lora_rank + qk_rope_head_dim values a token and layer
               (attention/mla.py); decodes attend in the latent space through the absorbed
               W_UK and W_UV (views of kv_b_proj's weight)
    MLP        dense SwiGLU on the first `first_k_dense_replace` layers, then routed experts
               plus shared experts (layers/deepseek_moe.py)

DeepSeek rotates interleaved pairs of the rope dims; the loader reorders those rows of the
q and kv_a projections (evens, then odds), so the rotate-half table of layers/rotary.py gives
the same scores.
"""

from __future__ import annotations

import math
import re
from types import SimpleNamespace

import torch
from torch import nn

from expresslane.attention.backend import AttentionBackend, AttentionMetadata
from expresslane.attention.mla import expanded_prefill, mla_for
from expresslane.distributed.group import TPGroup
from expresslane.distributed.layers import ColumnParallelLinear, RowParallelLinear, even_split
from expresslane.layers.deepseek_moe import DeepseekMoE
from expresslane.layers.moe import SparseMoE
from expresslane.layers.norm import RMSNorm
from expresslane.layers.rotary import RotaryEmbedding, rope_parameters
from expresslane.models.llama import MLP, LlamaForCausalLM
from expresslane.quant import QuantConfig

LATENT_NORM_EPS = 1e-6  # q_a_layernorm and kv_a_layernorm: transformers' default, not rms_norm_eps


class HeadParallelLinear(ColumnParallelLinear):
    """Output rows of whole heads: this rank's heads [first, first + n) of `per_head` rows each."""

    def __init__(self, in_features: int, first: int, n: int, per_head: int):
        super().__init__(in_features, [(first * per_head, n * per_head)], bias=False)

    def load(self, part: str, tensor: torch.Tensor, shard: None) -> None:
        super().load(part, tensor, 0)


def softmax_scale(cfg) -> float:
    """(qk_nope + qk_rope) ** -0.5, times mscale ** 2 under YaRN with `mscale_all_dim`."""
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    _, scaling = rope_parameters(cfg)
    mscale_all_dim = (scaling or {}).get("mscale_all_dim") or 0
    if mscale_all_dim and float(scaling["factor"]) > 1:
        mscale = 0.1 * mscale_all_dim * math.log(float(scaling["factor"])) + 1.0
        scale *= mscale * mscale
    return scale


class MLAttention(nn.Module):
    def __init__(self, cfg, backend: AttentionBackend, rotary: RotaryEmbedding, tp: TPGroup):
        super().__init__()
        heads = cfg.num_attention_heads
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.latent = cfg.kv_lora_rank
        self.q_lora = cfg.q_lora_rank
        first, self.num_heads = even_split(heads, tp, "attention heads")
        qk = self.nope + self.rope
        bias = bool(getattr(cfg, "attention_bias", False))
        hidden = cfg.hidden_size

        def heads_linear(in_features: int, per_head: int) -> nn.Module:
            if tp.size == 1:
                return nn.Linear(in_features, heads * per_head, bias=False)
            return HeadParallelLinear(in_features, first, self.num_heads, per_head)

        if self.q_lora is None:
            self.q_proj = heads_linear(hidden, qk)
        else:
            self.q_a_proj = nn.Linear(hidden, self.q_lora, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora, LATENT_NORM_EPS, backend.fused_ops)
            self.q_b_proj = heads_linear(self.q_lora, qk)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.latent + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.latent, LATENT_NORM_EPS, backend.fused_ops)
        self.kv_b_proj = heads_linear(self.latent, self.nope + self.v_dim)
        self.o_proj = (nn.Linear(heads * self.v_dim, hidden, bias=bias) if tp.size == 1
                       else RowParallelLinear(heads * self.v_dim, hidden, bias, tp))
        self.scale = softmax_scale(cfg)
        self.rotary = rotary
        self.backend = backend  # the step's prepare() is the model backend's, as for every attention
        self.mla = mla_for(backend)
        self.kv_cache: torch.Tensor | None = None  # [blocks, block_size, latent + rope], bound by the runner

    def _absorbed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [H, nope, L], W_UV [H, v, L]): views of kv_b_proj's weight."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.latent)
        return w[:, :self.nope], w[:, self.nope:]

    def _expand(self, c_kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """c_kv [n, L] -> (k_nope [n, H, nope], v [n, H, v]), as transformers expands the cache."""
        kv = self.kv_b_proj(c_kv).view(-1, self.num_heads, self.nope + self.v_dim)
        return kv[..., :self.nope], kv[..., self.nope:]

    def forward(self, positions, x, meta: AttentionMetadata):
        q = self.q_proj(x) if self.q_lora is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(-1, self.num_heads, self.nope + self.rope)
        q_nope, q_pe = q[..., :self.nope], q[..., self.nope:]
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([self.latent, self.rope], dim=-1)
        q_pe = self.mla.rope_store(self.kv_cache, q_pe, c_kv, k_pe, self.kv_a_layernorm, self.rotary, positions, meta)
        # absorbed: every token on the Triton path, the decodes on the torch path (prefill expands)
        n = meta.num_decodes if self.mla.expands_prefill else x.shape[0]
        if n == x.shape[0]:  # every token absorbed: no shared output to copy into
            return self.o_proj(self._attend_absorbed(q_nope, q_pe, positions, meta).flatten(1))
        out = x.new_empty(x.shape[0], self.num_heads, self.v_dim)
        if n:
            out[:n] = self._attend_absorbed(q_nope[:n], q_pe[:n], positions[:n], meta)
        out[n:] = expanded_prefill(q_nope, q_pe, self.kv_cache, meta, self.scale, self._expand, self.v_dim)
        return self.o_proj(out.flatten(1))

    def _attend_absorbed(self, q_nope, q_pe, positions, meta: AttentionMetadata) -> torch.Tensor:
        """Attention in the latent space for these tokens (W_UK folded into the query, W_UV into the
        output): [n, H, v]."""
        w_uk, w_uv = self._absorbed()
        q_lat = torch.einsum("thn,hnl->thl", q_nope, w_uk)
        o_lat = self.mla.attend(q_lat, q_pe.contiguous(), self.kv_cache, positions, meta, self.scale)
        return torch.einsum("thl,hvl->thv", o_lat, w_uv)


class DeepseekDecoderLayer(nn.Module):
    fused_rows = 0  # the fused decode layer is Llama's

    def __init__(self, cfg, attn: MLAttention, mlp: nn.Module, fused: bool):
        super().__init__()
        self.self_attn, self.mlp = attn, mlp
        self.sparse = isinstance(mlp, SparseMoE)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, fused)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, fused)

    def fused_decode_refusal(self) -> str | None:
        return "multi-head latent attention"

    def forward(self, positions, x, residual, meta: AttentionMetadata):
        """(hidden, residual) in and out, as the Llama layer."""
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x, residual = self.post_attention_layernorm(self.self_attn(positions, x, meta), residual)
        return (self.mlp(x, meta.slot_mapping) if self.sparse else self.mlp(x)), residual


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    fp8_kv_cache = False  # the latent cache is not scaled per layer as FP8 K/V is
    supports_lora = False  # (the adapters target merged q|k|v projections, which MLA has not)
    backend_attention = False  # the latent cache's own kernels (attention/mla.py)

    def __init__(self, cfg, backend: AttentionBackend, quant: QuantConfig | None = None, tp: TPGroup | None = None):
        if quant is not None:
            raise ValueError(f"quantized weights ({quant.name}) are not supported for {type(self).__name__}; "
                             "use an unquantized checkpoint")
        if (getattr(cfg, "moe_layer_freq", 1) or 1) != 1:
            raise ValueError(f"moe_layer_freq {cfg.moe_layer_freq} is not supported (every layer past "
                             "first_k_dense_replace sparse: 1)")
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {cfg.hidden_act!r} is not supported (supported: silu)")
        # transformers' V2 rotates interleaved pairs always, V3 when rope_interleave
        self.interleaved = bool(getattr(cfg, "rope_interleave", True))
        super().__init__(cfg, backend, quant, tp)

    def make_layer(self, cfg, index: int, backend: AttentionBackend, quant, tp: TPGroup) -> nn.Module:
        mlp = self.make_mlp(cfg, index, quant, f"model.layers.{index}.mlp", tp, backend.fused_ops)
        return DeepseekDecoderLayer(cfg, MLAttention(cfg, backend, self.rotary, tp), mlp, backend.fused_ops)

    def make_mlp(self, cfg, index: int, quant, prefix: str, tp: TPGroup, fused: bool) -> nn.Module:
        if index < (cfg.first_k_dense_replace or 0) or not cfg.n_routed_experts:
            return MLP(cfg, None, prefix, tp, fused)
        shared = None
        if cfg.n_shared_experts:
            sizes = SimpleNamespace(hidden_size=cfg.hidden_size, mlp_bias=getattr(cfg, "mlp_bias", False),
                                    intermediate_size=cfg.moe_intermediate_size * cfg.n_shared_experts)
            shared = MLP(sizes, None, f"{prefix}.shared_experts", tp, fused)
        return DeepseekMoE(cfg, shared, tp, fused)

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """The latent cache of a layer: c_kv | k_pe a slot, no head axis."""
        return num_blocks, block_size, self.config.kv_lora_rank + self.config.qk_rope_head_dim

    def full_kv_values(self) -> int:
        """Values a token and layer would take as full K and V of this rank's heads (the start-up log)."""
        cfg = self.config
        return self.layers[0].self_attn.num_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim)

    @staticmethod
    def _map_name(hf_name: str) -> tuple[str, object]:
        """Attention tensors keep their names (no merged q|k|v); the MLPs merge gate|up as Llama's."""
        if ".self_attn." in hf_name:
            return hf_name.removeprefix("model."), None
        return LlamaForCausalLM._map_name(hf_name)

    def load_weights(self, weights) -> None:
        super().load_weights(self._decoder_tensors(weights))

    def _decoder_tensors(self, weights):
        """The checkpoint without V3's multi-token-prediction layers (numbered from num_hidden_layers:
        not used, as transformers ignores them), interleaved rope rows reordered."""
        for name, tensor in weights:
            layer = _LAYER.match(name)
            if layer and int(layer.group(1)) >= self.config.num_hidden_layers:
                continue
            yield name, self._rope_rows_reordered(name, tensor) if self.interleaved else tensor

    def _rope_rows_reordered(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The rows of the rope dims (per head in q; after the latent in kv_a) as evens, then odds."""
        cfg = self.config
        rope = cfg.qk_rope_head_dim
        order = torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)]).to(tensor.device)
        if name.endswith(("self_attn.q_proj.weight", "self_attn.q_b_proj.weight")):
            per_head = tensor.view(cfg.num_attention_heads, -1, tensor.shape[-1])
            nope = cfg.qk_nope_head_dim
            return torch.cat([per_head[:, :nope], per_head[:, nope:][:, order]], 1).view(-1, tensor.shape[-1])
        if ".self_attn.kv_a_proj_with_mqa." in name:
            latent, pe = tensor.split([cfg.kv_lora_rank, rope])
            return torch.cat([latent, pe[order]])
        return tensor


_LAYER = re.compile(r"model\.layers\.(\d+)\.")


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    pass


def checkpoint_shapes(config: dict) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, init) of every tensor of a DeepSeek checkpoint of `config` (config.json's
    fields), in checkpoint order: make-model's random weights (models/presets.py)."""
    h, heads, layers = config["hidden_size"], config["num_attention_heads"], config["num_hidden_layers"]
    nope, rope, v_dim = config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"]
    latent, q_lora = config["kv_lora_rank"], config.get("q_lora_rank")
    experts, moe_inter = config["n_routed_experts"], config["moe_intermediate_size"]
    out = [("model.embed_tokens.weight", (config["vocab_size"], h), "normal")]

    def swiglu(prefix: str, inter: int) -> list:
        shapes = {"gate_proj": (inter, h), "up_proj": (inter, h), "down_proj": (h, inter)}
        return [(f"{prefix}.{name}.weight", shape, "normal") for name, shape in shapes.items()]

    for i in range(layers):
        p = f"model.layers.{i}"
        a = f"{p}.self_attn"
        if q_lora is None:
            out.append((f"{a}.q_proj.weight", (heads * (nope + rope), h), "normal"))
        else:
            out += [(f"{a}.q_a_proj.weight", (q_lora, h), "normal"), (f"{a}.q_a_layernorm.weight", (q_lora,), "ones"),
                    (f"{a}.q_b_proj.weight", (heads * (nope + rope), q_lora), "normal")]
        out += [(f"{a}.kv_a_proj_with_mqa.weight", (latent + rope, h), "normal"),
                (f"{a}.kv_a_layernorm.weight", (latent,), "ones"),
                (f"{a}.kv_b_proj.weight", (heads * (nope + v_dim), latent), "normal"),
                (f"{a}.o_proj.weight", (h, heads * v_dim), "normal")]
        if i < (config.get("first_k_dense_replace") or 0) or not experts:
            out += swiglu(f"{p}.mlp", config["intermediate_size"])
        else:
            out.append((f"{p}.mlp.gate.weight", (experts, h), "normal"))
            if config.get("topk_method") == "noaux_tc":
                out.append((f"{p}.mlp.gate.e_score_correction_bias", (experts,), "zeros"))
            for e in range(experts):
                out += swiglu(f"{p}.mlp.experts.{e}", moe_inter)
            if config.get("n_shared_experts"):
                out += swiglu(f"{p}.mlp.shared_experts", moe_inter * config["n_shared_experts"])
        out += [(f"{p}.input_layernorm.weight", (h,), "ones"), (f"{p}.post_attention_layernorm.weight", (h,), "ones")]
    out.append(("model.norm.weight", (h,), "ones"))
    if not config.get("tie_word_embeddings", False):
        out.append(("lm_head.weight", (config["vocab_size"], h), "normal"))
    return out
