"""Mixtures of experts: Mixtral and Qwen3-MoE. Each is the Llama-family model (attention,
norms, weights loading) with a SparseMoE block (layers/moe.py) as the feed-forward of its
sparse layers.

    Mixtral     every layer sparse; top-k of the softmax, always renormalised to sum 1
    Qwen3-MoE   q/k RMSNorm; a layer is sparse unless listed in `mlp_only_layers` or off the
                `decoder_sparse_step` pattern (those keep a dense MLP of `intermediate_size`);
                experts of `moe_intermediate_size`; renormalised when `norm_topk_prob`

AWQ and GPTQ checkpoints quantize the experts too (INT4 weight-only, as vLLM's moe_wna16);
the router stays in the model dtype. FP8 MoE checkpoints are refused.
"""

from __future__ import annotations

from torch import nn

from expresslane.attention.backend import AttentionBackend
from expresslane.distributed.group import TPGroup
from expresslane.layers.moe import SparseMoE, num_experts_of
from expresslane.models.llama import LlamaForCausalLM
from expresslane.quant import QuantConfig
from expresslane.quant.int4 import Int4Method


class _MoEModel(LlamaForCausalLM):
    expert_projections = ("gate_proj", "up_proj", "down_proj")  # HF names of an expert's three

    def __init__(self, cfg, backend: AttentionBackend, quant: QuantConfig | None = None, tp: TPGroup | None = None):
        if quant is not None and not isinstance(quant.method, Int4Method):
            raise ValueError(f"quantized weights ({quant.name}) are not supported for mixture-of-experts models; "
                             "use an unquantized, AWQ or GPTQ checkpoint")
        super().__init__(cfg, backend, quant, tp)

    def expert_quant(self, quant: QuantConfig | None, prefix: str) -> Int4Method | None:
        """The INT4 method of the experts under `prefix`, unless the checkpoint leaves them unquantized."""
        if quant is None or not quant.quantizes([f"{prefix}.experts.0.{p}" for p in self.expert_projections]):
            return None
        return quant.method


class MixtralForCausalLM(_MoEModel):
    expert_projections = ("w1", "w3", "w2")
    window_layers = "all"

    def make_mlp(self, cfg, index: int, quant, prefix: str, tp: TPGroup, fused: bool) -> nn.Module:
        hf_prefix = prefix.replace(".mlp", ".block_sparse_moe")
        return SparseMoE(cfg.hidden_size, cfg.intermediate_size, num_experts_of(cfg), cfg.num_experts_per_tok,
                         True, tp, fused, self.expert_quant(quant, hf_prefix))


class Qwen3MoeForCausalLM(_MoEModel):
    qk_norm = True
    window_layers = "all"

    def make_mlp(self, cfg, index: int, quant, prefix: str, tp: TPGroup, fused: bool) -> nn.Module:
        experts = num_experts_of(cfg)
        step = getattr(cfg, "decoder_sparse_step", 1) or 1
        if index in (getattr(cfg, "mlp_only_layers", None) or []) or not experts or (index + 1) % step:
            return super().make_mlp(cfg, index, quant, prefix, tp, fused)
        return SparseMoE(cfg.hidden_size, cfg.moe_intermediate_size, experts, cfg.num_experts_per_tok,
                         bool(getattr(cfg, "norm_topk_prob", False)), tp, fused, self.expert_quant(quant, prefix))
