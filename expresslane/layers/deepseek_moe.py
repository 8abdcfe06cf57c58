"""DeepSeek's mixture of experts: a SparseMoE (layers/moe.py: stacked experts, fused or torch
paths, tensor and expert parallelism, load counters) with DeepSeek's routing and shared experts.

    V2  softmax scores; top-k ("greedy"), or top-k within the `topk_group` groups (of `n_group`)
        with the highest best score ("group_limited_greedy")
    V3  sigmoid scores; choice by score + e_score_correction_bias, within the `topk_group`
        groups whose two best biased scores sum highest ("noaux_tc"); weights are the unbiased
        scores of the chosen, renormalised when `norm_topk_prob`
    all weights times `routed_scaling_factor`; output = routed experts + shared experts (a dense
        SwiGLU MLP of n_shared_experts * moe_intermediate_size) of the same input

The router runs in float32 (its weight kept in float32, as transformers keeps it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from expresslane.distributed.expert_parallel import dispatch_combine
from expresslane.distributed.group import TPGroup
from expresslane.layers.moe import SparseMoE

@dataclass(frozen=True, slots=True)
class Routing:
    method: str  # "greedy", "group_limited_greedy" (V2) or "noaux_tc" (V3)
    n_group: int
    topk_group: int
    renormalize: bool
    scaling: float  # routed_scaling_factor


def routing_of(cfg) -> Routing:
    """The config's routing, as transformers' class of its version computes it; others refused by name."""
    v3 = cfg.model_type == "deepseek_v3"
    method = getattr(cfg, "topk_method", None) or ("noaux_tc" if v3 else "greedy")
    allowed = ("noaux_tc",) if v3 else ("greedy", "group_limited_greedy")
    if method not in allowed:
        raise ValueError(f"topk_method {method!r} is not supported for {cfg.model_type} (supported: "
                         f"{', '.join(allowed)})")
    scoring = getattr(cfg, "scoring_func", None) or ("sigmoid" if v3 else "softmax")
    if scoring != ("sigmoid" if v3 else "softmax"):
        raise ValueError(f"scoring_func {scoring!r} is not supported for {cfg.model_type}")
    if not v3 and getattr(cfg, "norm_topk_prob", False):
        raise ValueError("norm_topk_prob true is not supported for deepseek_v2 (transformers' DeepSeek-V2 "
                         "router never renormalises)")
    if method == "greedy":
        return Routing(method, 1, 1, False, float(cfg.routed_scaling_factor))
    n_group, topk_group = cfg.n_group or 1, cfg.topk_group or 1
    if cfg.n_routed_experts % n_group or not 1 <= topk_group <= n_group:
        raise ValueError(f"n_group {cfg.n_group} must divide the {cfg.n_routed_experts} routed experts and "
                         f"topk_group {cfg.topk_group} be in [1, n_group]")
    return Routing(method, n_group, topk_group, v3 and bool(getattr(cfg, "norm_topk_prob", False)),
                   float(cfg.routed_scaling_factor))


def _group_mask(scores: torch.Tensor, group_scores: torch.Tensor, topk_group: int) -> torch.Tensor:
    """[T, E] bool: the experts of each token's `topk_group` best groups."""
    t, groups = group_scores.shape
    best = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    return mask[:, :, None].expand(t, groups, scores.shape[1] // groups).reshape(t, -1)


def route_deepseek(logits: torch.Tensor, top_k: int, routing: Routing,
                   bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 router logits [T, E] -> (weights [T, k] float32, expert ids [T, k] int64); `bias`:
    V3's e_score_correction_bias."""
    if routing.method == "noaux_tc":
        scores = logits.sigmoid()
        biased = scores + bias
        groups = biased.view(len(biased), routing.n_group, -1).topk(2, dim=-1)[0].sum(dim=-1)
        biased = biased.masked_fill(~_group_mask(biased, groups, routing.topk_group), float("-inf"))
        ids = torch.topk(biased, k=top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
    else:
        scores = logits.softmax(dim=-1)
        if routing.method == "group_limited_greedy":
            groups = scores.view(len(scores), routing.n_group, -1).max(dim=-1).values
            scores = scores.masked_fill(~_group_mask(scores, groups, routing.topk_group), 0.0)
        weights, ids = torch.topk(scores, k=top_k, dim=-1, sorted=False)
    if routing.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routing.scaling, ids


class DeepseekMoE(SparseMoE):
    def __init__(self, cfg, shared: nn.Module | None, tp: TPGroup, fused: bool):
        """`shared`: the shared experts' MLP (None: the config has none)."""
        self.routing = routing_of(cfg)
        super().__init__(cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts, cfg.num_experts_per_tok,
                         self.routing.renormalize, tp, fused)
        self.gate = nn.Linear(cfg.hidden_size, cfg.n_routed_experts, bias=False, dtype=torch.float32)
        if self.routing.method == "noaux_tc":
            self.gate.e_score_correction_bias = nn.Parameter(torch.zeros(cfg.n_routed_experts, dtype=torch.float32),
                                                             requires_grad=False)  # (its checkpoint name)
        self.shared_experts = shared

    def forward(self, x: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]; tokens with slot -1 (CUDA-graph padding) are not counted."""
        logits = F.linear(x.float(), self.gate.weight)
        if self.fused and self.routing.method == "greedy":  # one kernel: softmax, top-k, scaling, counters
            from expresslane.layers.fused_moe import fused_route
            weights, ids = fused_route(logits, self.top_k, False, self.expert_tokens, slot_mapping,
                                       scale=self.routing.scaling)
        else:
            bias = self.gate.e_score_correction_bias if self.routing.method == "noaux_tc" else None
            weights, ids = route_deepseek(logits, self.top_k, self.routing, bias)
            real = (slot_mapping >= 0).to(torch.int64)
            self.expert_tokens.scatter_add_(0, ids.flatten(), real[:, None].expand(ids.shape).flatten())
        if self.tp.expert_parallel:
            out = dispatch_combine(x, weights, ids, self.experts_per_rank, self.tp, self.experts)
        else:
            out = self.tp.all_reduce(self.experts(x, weights, ids, all_routed=True))
        return out if self.shared_experts is None else out + self.shared_experts(x)
