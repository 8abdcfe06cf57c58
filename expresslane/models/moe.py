"""Mixtures of experts: Mixtral and Qwen3-MoE. Each is the Llama-family model (attention,
norms, weights loading) with a SparseMoE block (layers/moe.py) as the feed-forward of its
sparse layers.

    Mixtral     every layer sparse; top-k of the softmax, always renormalised to sum 1
    Qwen3-MoE   q/k RMSNorm; a layer is sparse unless listed in `mlp_only_layers` or off the
                `decoder_sparse_step` pattern (those keep a dense MLP of `intermediate_size`);
                experts of `moe_intermediate_size`; renormalised when `norm_topk_prob`
"""

from __future__ import annotations

from torch import nn

from expresslane.attention.backend import AttentionBackend
from expresslane.distributed.group import TPGroup
from expresslane.layers.moe import SparseMoE, num_experts_of
from expresslane.models.llama import LlamaForCausalLM
from expresslane.quant import QuantConfig


class _MoEModel(LlamaForCausalLM):
    def __init__(self, cfg, backend: AttentionBackend, quant: QuantConfig | None = None, tp: TPGroup | None = None):
        if quant is not None:
            raise ValueError(f"quantized weights ({quant.name}) are not supported for mixture-of-experts models "
                             "yet; use an unquantized checkpoint")
        super().__init__(cfg, backend, quant, tp)


class MixtralForCausalLM(_MoEModel):
    def make_mlp(self, cfg, index: int, quant, prefix: str, tp: TPGroup, fused: bool) -> nn.Module:
        return SparseMoE(cfg.hidden_size, cfg.intermediate_size, num_experts_of(cfg), cfg.num_experts_per_tok,
                         True, tp, fused)


class Qwen3MoeForCausalLM(_MoEModel):
    qk_norm = True

    def make_mlp(self, cfg, index: int, quant, prefix: str, tp: TPGroup, fused: bool) -> nn.Module:
        experts = num_experts_of(cfg)
        step = getattr(cfg, "decoder_sparse_step", 1) or 1
        if index in (getattr(cfg, "mlp_only_layers", None) or []) or not experts or (index + 1) % step:
            return super().make_mlp(cfg, index, quant, prefix, tp, fused)
        return SparseMoE(cfg.hidden_size, cfg.moe_intermediate_size, experts, cfg.num_experts_per_tok,
                         bool(getattr(cfg, "norm_topk_prob", False)), tp, fused)
