"""Gemma 2 and Gemma 3 (text): the Llama-family model (models/llama.py: projections, weights
loading, tensor parallelism) with what Gemma does differently, as transformers computes it:

    norms       RMSNorm scaled by (1 + w), in float32, rounded once; four a layer: before and
                after attention, before and after the MLP (the residual adds the post-norms' output)
    embedding   times sqrt(hidden_size), rounded to the model dtype first
    MLP         GeGLU: gelu (tanh approximation) of the gate times up
    attention   scale query_pre_attn_scalar ** -0.5; Gemma 2 caps each score at
                attn_logit_softcapping (softcap * tanh(s / softcap)); Gemma 3 normalises q and k
                per head and gives its sliding layers their own RoPE base (the local one)
    logits      capped at final_logit_softcapping (when set)

With the `triton` backend the norms (residual add included) and GeGLU are fused Triton kernels,
as Llama's are (layers/triton_ops.py): two launches a layer for the four norms (the post-attention
norm joins the pre-MLP norm's pass, the post-MLP norm the next layer's input norm), and Gemma 3's
q/k norms run in the attention backend's RoPE and KV-write kernel.

A layer's attention keeps its `sliding_window` (None on global layers), which the attention
backends apply; the global layers read every key, so the KV manager frees no block.
"""

from __future__ import annotations

import torch
from torch import nn

from expresslane.attention.backend import AttentionBackend, AttentionMetadata
from expresslane.distributed.group import TPGroup
from expresslane.distributed.layers import VocabParallelEmbedding
from expresslane.layers.activation import gelu_and_mul
from expresslane.layers.rotary import RopeFrequencies, RotaryEmbedding, default_inv_freq, rope_parameters
from expresslane.models.llama import MLP, Attention, LlamaForCausalLM
from expresslane.quant import QuantConfig

SLIDING, FULL = "sliding_attention", "full_attention"
ACTIVATIONS = ("gelu_pytorch_tanh",)  # gelu with the tanh approximation, as torch computes it


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + w), computed in float32 and rounded to x's dtype once (w stays as loaded:
    storing 1 + w in bfloat16 would round it); one fused Triton pass when `fused`."""
    offset = True

    def __init__(self, size: int, eps: float, fused: bool = False):
        super().__init__()
        self.eps = eps
        self.fused = fused
        self.weight = nn.Parameter(torch.zeros(size))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        f = x.float()
        f = f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + self.eps)
        return (f * (1.0 + self.weight.float())).to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, pre: GemmaRMSNorm | None = None):
        """As RMSNorm.forward: norm(x), or (norm(x + residual), x + residual). `pre` (with a
        residual): x is a sublayer's output that `pre` normalises before the add, fused in one pass."""
        if self.fused:
            from expresslane.layers.triton_ops import rms_norm
            return rms_norm(x, self.weight, self.eps, residual, offset=True,
                            pre_weight=None if pre is None else pre.weight)
        if pre is not None:
            x = pre(x)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x


class _ScaledEmbedding:
    """The embedding times `embed_scale` (a buffer in the weight's dtype)."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * self.embed_scale


class ScaledEmbedding(_ScaledEmbedding, nn.Embedding):
    pass


class ScaledVocabParallelEmbedding(_ScaledEmbedding, VocabParallelEmbedding):
    pass


class GemmaMLP(MLP):
    def forward(self, x):
        return self.down_proj(gelu_and_mul(self.gate_up_proj(x), self.fused, self.fp8_act))


class GemmaAttention(Attention):
    def __init__(self, cfg, backend: AttentionBackend, rotary: RotaryEmbedding, layer_type: str, qk_norm: bool,
                 quant: QuantConfig | None, prefix: str, tp: TPGroup):
        super().__init__(cfg, backend, rotary, False, False, quant, prefix, tp)
        self.scale = float(cfg.query_pre_attn_scalar) ** -0.5
        self.softcap = getattr(cfg, "attn_logit_softcapping", None)
        self.sliding_window = cfg.sliding_window if layer_type == SLIDING else None
        if qk_norm:  # over the head dim of [T, heads, D]; the backend applies them with RoPE
            self.q_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps, backend.fused_ops)
            self.k_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps, backend.fused_ops)


class GemmaDecoderLayer(nn.Module):
    sparse = False
    fused_rows = 0  # the fused decode layer is Llama's layer

    def __init__(self, cfg, attn: GemmaAttention, mlp: GemmaMLP, fused: bool):
        super().__init__()
        self.self_attn, self.mlp = attn, mlp
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            setattr(self, name, GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, fused))

    def fused_decode_refusal(self) -> str | None:
        return "Gemma's layers (four (1 + w) norms, GeGLU)"

    def forward(self, positions, x, residual, meta: AttentionMetadata, pre: GemmaRMSNorm | None = None):
        """(hidden, residual) in: their sum is the residual stream, as the Llama layer's, once `pre`
        (the previous layer's post-MLP norm, None for hidden as it is) has normalised hidden; the
        input norm runs them in one pass. Out: the MLP's output before this layer's post-MLP norm,
        and the residual (Gemma2ForCausalLM.run_layers hands the norm on to the next layer)."""
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual, pre=pre)
        x, residual = self.pre_feedforward_layernorm(self.self_attn(positions, x, meta), residual,
                                                     pre=self.post_attention_layernorm)
        return self.mlp(x), residual


def layer_types(cfg, pattern: int) -> list[str]:
    """Each layer's kind: config.json's `layer_types`, or else every `sliding_window_pattern`-th
    layer global (`pattern`: the family's default)."""
    n = cfg.num_hidden_layers
    types = getattr(cfg, "layer_types", None)
    if types is None:
        pattern = getattr(cfg, "sliding_window_pattern", None) or pattern
        return [SLIDING if (i + 1) % pattern else FULL for i in range(n)]
    types = list(types)
    if len(types) != n or not set(types) <= {SLIDING, FULL}:
        raise ValueError(f"layer_types must list {n} entries of {SLIDING!r} or {FULL!r}, got {types}")
    return types


def layer_rope(cfg, layer_type: str) -> tuple[float, dict | None]:
    """(theta, scaling) of one kind of layer: transformers 5 keeps one entry per kind in
    `rope_parameters`; 4.x configs give sliding layers `rope_local_base_freq`, unscaled."""
    params = getattr(cfg, "rope_parameters", None) or {}
    if layer_type in params:
        p = params[layer_type]
        return float(p["rope_theta"]), (p if p.get("rope_type", "default") != "default" else None)
    local = getattr(cfg, "rope_local_base_freq", None)
    if layer_type == SLIDING and local is not None:
        return float(local), None
    return rope_parameters(cfg)


def gemma_rotary(head_dim: int, max_position: int, theta: float, scaling: dict | None) -> RotaryEmbedding:
    """One layer kind's table: default frequencies, or linearly scaled ones (Gemma 3's global layers)."""
    inv_freq = default_inv_freq(theta, head_dim)
    kind = scaling.get("rope_type", scaling.get("type")) if scaling else "default"
    if kind == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif kind != "default":
        raise ValueError(f"unsupported rope scaling {kind!r} for Gemma's layer kinds (supported: default, linear)")
    return RotaryEmbedding(head_dim, max_position, freqs=RopeFrequencies(kind, inv_freq))


class Gemma2ForCausalLM(LlamaForCausalLM):
    window_pattern = 2  # every other layer global, when config.json lists no layer types
    qk_norm = False

    @classmethod
    def attention_windows(cls, cfg) -> list[int | None]:
        return [cfg.sliding_window if kind == SLIDING else None for kind in layer_types(cfg, cls.window_pattern)]

    def __init__(self, cfg, backend: AttentionBackend, quant: QuantConfig | None = None, tp: TPGroup | None = None):
        act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", None)
        if act not in ACTIVATIONS:
            raise ValueError(f"hidden_activation {act!r} is not supported for {type(self).__name__} "
                             f"(supported: {', '.join(ACTIVATIONS)})")
        if getattr(cfg, "use_bidirectional_attention", False):
            raise ValueError("use_bidirectional_attention is not supported (causal attention only)")
        self.final_softcap = getattr(cfg, "final_logit_softcapping", None)
        self.layer_types = layer_types(cfg, self.window_pattern)
        super().__init__(cfg, backend, quant, tp)

    def make_embedding(self, cfg, tp: TPGroup) -> nn.Module:
        emb = (ScaledVocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp) if tp.size > 1
               else ScaledEmbedding(cfg.vocab_size, cfg.hidden_size))
        scale = torch.tensor(cfg.hidden_size ** 0.5, dtype=torch.float32).to(emb.weight.dtype)
        emb.register_buffer("embed_scale", scale, persistent=False)
        return emb

    def make_rotary(self, cfg, head_dim: int) -> RotaryEmbedding:
        """The global layers' table; sliding layers with another base get `local_rotary`."""
        rotary = gemma_rotary(head_dim, cfg.max_position_embeddings, *layer_rope(cfg, FULL))
        local = layer_rope(cfg, SLIDING)
        same = local == layer_rope(cfg, FULL)
        self.local_rotary = rotary if same else gemma_rotary(head_dim, cfg.max_position_embeddings, *local)
        return rotary

    def make_layer(self, cfg, index: int, backend: AttentionBackend, quant: QuantConfig | None,
                   tp: TPGroup) -> nn.Module:
        prefix = f"model.layers.{index}"
        kind = self.layer_types[index]
        rotary = self.local_rotary if kind == SLIDING else self.rotary
        attn = GemmaAttention(cfg, backend, rotary, kind, self.qk_norm, quant, f"{prefix}.self_attn", tp)
        mlp = GemmaMLP(cfg, quant, f"{prefix}.mlp", tp, backend.fused_ops)
        return GemmaDecoderLayer(cfg, attn, mlp, backend.fused_ops)

    def make_norm(self, cfg, fused: bool) -> nn.Module:
        return GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, fused)

    def run_layers(self, positions, x, residual, meta: AttentionMetadata, start: int, end: int):
        """As the Llama model's, (hidden, residual) summing to the residual stream at both ends; within
        the range each layer's post-MLP norm runs in the next layer's input-norm pass, and the last
        layer's alone."""
        pre = None
        for layer in self.layers[start:end]:
            x, residual = layer(positions, x, residual, meta, pre)
            pre = layer.post_feedforward_layernorm
        return (x if pre is None else pre(x)), residual

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """float32 logits, capped at final_logit_softcapping (in float32) when it is set."""
        logits = super().compute_logits(hidden, out)
        if self.final_softcap is None:
            return logits
        return logits.div_(self.final_softcap).tanh_().mul_(self.final_softcap)


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    window_pattern = 6
    qk_norm = True

    def load_weights(self, weights) -> None:
        if getattr(self.config, "served_text_of", None):  # a Gemma3ForConditionalGeneration checkpoint
            weights = text_weights(weights)
        super().load_weights(weights)


# a multimodal checkpoint's tensor name prefix -> ours (None: the vision side, not loaded), the first
# that matches: the hub's layout, transformers' own, and the text names (random weights, make-model)
_TEXT_PREFIXES = {"language_model.model.": "model.", "model.language_model.": "model.",
                  "language_model.lm_head.": "lm_head.", "vision_tower.": None, "model.vision_tower.": None,
                  "multi_modal_projector.": None, "model.multi_modal_projector.": None, "model.": "model.",
                  "lm_head.": "lm_head."}


def text_weights(weights):
    """The text model's (name, tensor) of a multimodal checkpoint, renamed as a text checkpoint names them."""
    for name, tensor in weights:
        prefix = next((p for p in _TEXT_PREFIXES if name.startswith(p)), None)
        if prefix is None:
            raise ValueError(f"checkpoint tensor {name!r} belongs to neither the text model nor the vision tower")
        if _TEXT_PREFIXES[prefix] is not None:
            yield _TEXT_PREFIXES[prefix] + name.removeprefix(prefix), tensor
