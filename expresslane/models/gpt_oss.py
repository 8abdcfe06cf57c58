"""gpt-oss: the Llama-family model (models/llama.py: attention, norms, weights loading, tensor
parallelism) with what gpt-oss does differently, as transformers' GptOssForCausalLM computes it:

    attention   q/k/v and o projections with biases; a learned sink logit per head joins each
                softmax's denominator (the backends' `sinks`); `layer_types` alternate sliding
                (window `sliding_window`) and full attention; YaRN RoPE
    MoE         every layer: a router with a bias, softmax over its top-k logits; experts with
                gate|up and down biases and the clamped SwiGLU (layers/moe.py ClampedSwiGLU)

The checkpoint stacks each layer's experts: ``experts.gate_up_proj`` [E, H, 2I] with gate and
up columns interleaved (gate at even columns), ``down_proj`` [E, I, H] (both input-major), and
their biases ``gate_up_proj_bias`` [E, 2I] (interleaved), ``down_proj_bias`` [E, H]. As shipped
(`quantization_config` mxfp4) the two weights are ``*_blocks`` and ``*_scales`` instead
(quant/mxfp4.py: output-major, [E, 2I, H / 32, 16] and [E, H, I / 32, 16]); they stay packed
(4.25 bits a weight) and the fused grouped GEMMs decode them in the kernel (the torch reference
dequantizes one expert at a time as it runs).
"""

from __future__ import annotations

import torch
from torch import nn

from expresslane.attention.backend import AttentionBackend
from expresslane.distributed.group import TPGroup
from expresslane.distributed.layers import head_split
from expresslane.layers.moe import ClampedSwiGLU, SparseMoE
from expresslane.models.llama import Attention, DecoderLayer, LlamaForCausalLM
from expresslane.quant import QuantConfig

_EXPERTS = ".mlp.experts."
_PARTS = ("gate_up_proj", "down_proj")


class GptOssAttention(Attention):
    """Llama's attention with a sink logit per head (this rank's heads under tensor parallelism)."""

    def __init__(self, cfg, backend: AttentionBackend, rotary, qkv_bias: bool, qk_norm: bool, quant, prefix: str,
                 tp: TPGroup, window: int | None = None):
        super().__init__(cfg, backend, rotary, qkv_bias, qk_norm, quant, prefix, tp, window)
        _, self.first_head, _, _ = head_split(cfg.num_attention_heads, cfg.num_key_value_heads, tp)
        self.sinks = nn.Parameter(torch.empty(self.num_heads))

    def load(self, part: str, tensor: torch.Tensor, shard) -> None:
        """The checkpoint's `sinks` [all heads]: this rank's slice (the loader calls `load` on the
        owner of a parameter that has one)."""
        heads = self.num_heads
        if part != "sinks" or tensor.dim() != 1 or tensor.shape[0] < self.first_head + heads:
            raise ValueError(f"checkpoint tensor self_attn.{part} of shape {tuple(tensor.shape)}: expected the "
                             f"sinks of every head (this rank has heads {self.first_head}..{self.first_head + heads})")
        self.sinks.data.copy_(tensor[self.first_head:self.first_head + heads])


class GptOssDecoderLayer(DecoderLayer):
    attention_cls = GptOssAttention


class GptOssForCausalLM(LlamaForCausalLM):
    window_layers = "layer_types"

    def __init__(self, cfg, backend: AttentionBackend, quant: QuantConfig | None = None, tp: TPGroup | None = None):
        if quant is not None:
            raise ValueError(f"quantized weights ({quant.name}) are not supported for gpt-oss; use the checkpoint "
                             "as shipped (MXFP4 experts) or an unquantized one")
        if not getattr(cfg, "attention_bias", True):
            raise ValueError("config.json: gpt-oss needs attention_bias true (its projections have biases)")
        qc = getattr(cfg, "quantization_config", None) or {}
        method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
        if method not in (None, "mxfp4"):
            raise ValueError(f"config.json: gpt-oss quantized with {method!r} is not supported (mxfp4 or none)")
        self.mxfp4 = method == "mxfp4"  # the experts stay in MXFP4, as shipped
        super().__init__(cfg, backend, quant, tp)

    def make_layer(self, cfg, index: int, backend: AttentionBackend, quant, tp: TPGroup) -> nn.Module:
        prefix = f"model.layers.{index}"
        mlp = self.make_mlp(cfg, index, quant, f"{prefix}.mlp", tp, backend.fused_ops)
        return GptOssDecoderLayer(cfg, backend, self.rotary, True, False, quant, prefix, tp, mlp, self.windows[index])

    def make_mlp(self, cfg, index: int, quant, prefix: str, tp: TPGroup, fused: bool) -> nn.Module:
        act = ClampedSwiGLU(float(getattr(cfg, "swiglu_alpha", 1.702)), float(getattr(cfg, "swiglu_limit", 7.0)))
        return SparseMoE(cfg.hidden_size, cfg.intermediate_size, cfg.num_local_experts, cfg.num_experts_per_tok,
                         False, tp, fused, topk_softmax=True, biased=True, act=act, mxfp4=self.mxfp4)

    def load_weights(self, weights) -> None:
        super().load_weights(self._per_expert(weights))

    def _per_expert(self, weights):
        """The checkpoint's tensors as the Llama loader reads them: the router as `mlp.gate`,
        each stacked expert family cut into one tensor per expert and projection (gate/up
        de-interleaved; float weights made output-major, as MXFP4's already are)."""
        for name, tensor in weights:
            if ".mlp.router." in name:
                yield name.replace(".mlp.router.", ".mlp.gate."), tensor
                continue
            if _EXPERTS not in name:
                yield name, tensor
                continue
            prefix, _, part = name.rpartition(_EXPERTS)
            base, _, kind = part.rpartition("_")
            if base not in _PARTS or kind not in ("bias", "blocks", "scales"):
                base, kind = part, "weight"
            if base not in _PARTS:
                raise ValueError(f"checkpoint tensor {name!r}: unknown gpt-oss expert tensor (expected "
                                 f"{', '.join(_PARTS)}, their _bias, or MXFP4 _blocks and _scales)")
            if kind in ("blocks", "scales") and not self.mxfp4:
                raise ValueError(f"checkpoint tensor {name!r} is MXFP4, but config.json has no quantization_config "
                                 "with quant_method mxfp4")
            yield from _split(prefix, base, kind, tensor.transpose(1, 2) if kind == "weight" else tensor)


def _split(prefix: str, base: str, kind: str, stacked: torch.Tensor):
    """(name, tensor) per expert from output-major stacked [E, N, ...]: gate_up's rows (or bias
    entries) alternate gate, up."""
    for e, t in enumerate(stacked):
        name = f"{prefix}{_EXPERTS}{e}"
        if base == "down_proj":
            yield f"{name}.down_proj.{kind}", t
        else:
            yield f"{name}.gate_proj.{kind}", t[0::2]
            yield f"{name}.up_proj.{kind}", t[1::2]
