"""Mixture-of-experts feed-forward: a router picks `top_k` of `num_experts` SwiGLU experts per
token, and the token's output is the routing-weighted sum of theirs.

    route:   probs = softmax(x @ gate^T) (float32); top_k of them; renormalised to sum 1
             when the model says so (Mixtral always, Qwen3-MoE per `norm_topk_prob`);
             `topk_softmax` (gpt-oss): the top_k logits (router bias added), softmax over them
    experts: y = sum_j w_j * down_e(silu(gate_e(x)) * up_e(x)),  e = the j-th chosen expert;
             `biased` (gpt-oss): each projection adds its bias; `act` ClampedSwiGLU (gpt-oss)
             in place of silu(gate) * up

Expert weights are stacked: ``w13`` [E, 2I, H] (gate rows, then up rows) and ``w2`` [E, H, I];
in an AWQ or GPTQ checkpoint they are INT4 (``quant/int4_experts.py``: the same two families,
packed, dequantized inside the fused GEMMs), in gpt-oss's as shipped MXFP4 (``quant/mxfp4.py``,
decoded inside the fused GEMMs too).
Two paths compute the experts: the fused Triton kernels (``fused_moe.py``: tokens aligned by
expert, one grouped GEMM for gate/up with SiLU-and-mul, one for down; no host sync, so CUDA
graphs capture it) when the attention backend is `triton`, and the plain torch reference
below otherwise (CPU, tests). Expert id -1 means "not here" (expert parallelism: the row
belongs to another rank) and contributes nothing.

Tensor parallelism splits every expert's intermediate size over the ranks (partial outputs
summed by an all-reduce); with ``expert_parallel`` each rank holds whole experts, a 1/N
share of them, and tokens travel to their experts' ranks (``distributed/expert_parallel.py``).
Each block counts the tokens routed to each of its experts on the device
(``expert_tokens``, read by the engine at a low rate for ``/metrics``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from expresslane.distributed.expert_parallel import dispatch_combine
from expresslane.distributed.group import TPGroup
from expresslane.distributed.layers import even_split
from expresslane.quant.int4 import Int4Method
from expresslane.quant.int4_experts import Int4Experts
from expresslane.quant.mxfp4 import BLOCK, Mxfp4Experts


@dataclass(frozen=True, slots=True)
class ClampedSwiGLU:
    """gpt-oss's expert activation of (gate, up): gate clamped to at most `limit`, up to
    [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate)."""

    alpha: float = 1.702
    limit: float = 7.0

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate = gate.clamp(max=self.limit)
        up = up.clamp(-self.limit, self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool,
          topk_softmax: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, expert ids [T, k] int64), best expert first. `topk_softmax`: the
    softmax over the chosen logits only (renormalize is then moot)."""
    if topk_softmax:
        logits, ids = torch.topk(router_logits.float(), top_k, dim=-1)
        return torch.softmax(logits, dim=-1), ids
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def torch_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                  ids: torch.Tensor, b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                  act: ClampedSwiGLU | None = None) -> torch.Tensor:
    """The reference: each expert runs on the rows routed to it (a host sync per call: CPU and
    tests only). x [T, H]; weights, ids [T, k] (id -1: skipped) -> [T, H] in x's dtype; b13
    [E, 2I] and b2 [E, H]: the projections' biases; `act`: in place of SiLU-and-mul."""
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat + 1, minlength=w13.shape[0] + 1).tolist()
    start = counts[0]  # rows routed nowhere here come first
    for expert, n in enumerate(counts[1:]):
        if n:
            picked = order[start:start + n]
            rows = picked // ids.shape[1]
            gate, up = F.linear(x[rows], w13[expert].to(x.dtype), None if b13 is None else b13[expert]).chunk(2, -1)
            y = F.linear(F.silu(gate) * up if act is None else act(gate, up), w2[expert].to(x.dtype),
                         None if b2 is None else b2[expert])
            out.index_add_(0, rows, y.float() * weights.flatten()[picked, None])
        start += n
    return out.to(x.dtype)


def num_experts_of(cfg) -> int:
    """Mixtral says num_local_experts, Qwen3-MoE num_experts (transformers 5 maps one onto the other)."""
    return getattr(cfg, "num_local_experts", None) or cfg.num_experts


def check_expert_split(num_experts: int, ranks: int) -> None:
    """Expert parallelism gives every rank at least one expert."""
    if -(-num_experts // ranks) * (ranks - 1) >= num_experts:
        raise ValueError(f"expert parallelism over {ranks} ranks leaves a rank without experts: the model has "
                         f"{num_experts}")


class SparseMoE(nn.Module):
    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int, renormalize: bool,
                 tp: TPGroup, fused: bool, int4: Int4Method | None = None, topk_softmax: bool = False,
                 biased: bool = False, act: ClampedSwiGLU | None = None, mxfp4: bool = False):
        """`topk_softmax`, `biased`, `act`: gpt-oss's routing, biases and activation (module doc);
        `mxfp4`: its experts as shipped."""
        super().__init__()
        if int4 is not None and (biased or act is not None):
            raise ValueError("INT4 experts with biases or the clamped SwiGLU are not supported")
        self.topk_softmax, self.act = topk_softmax, act
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok {top_k} must be in [1, {num_experts}] (the model's experts)")
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.tp, self.fused = tp, fused
        if tp.expert_parallel:  # whole experts: ceil(E / N) a rank, the last rank the rest
            check_expert_split(num_experts, tp.size)
            self.experts_per_rank = -(-num_experts // tp.size)
            self.first_expert = tp.rank * self.experts_per_rank
            local_experts = min(self.experts_per_rank, num_experts - self.first_expert)
            self.inter_start, local_inter = 0, intermediate
        else:  # every expert, a slice of each one's intermediate size
            self.first_expert, local_experts = 0, num_experts
            self.inter_start, local_inter = even_split(intermediate, tp, "MoE intermediate size")
        self.intermediate = intermediate
        self.gate = nn.Linear(hidden, num_experts, bias=biased)  # the router, replicated on every rank
        if mxfp4:  # a rank's slice of the intermediate size is whole blocks of down's inputs
            if local_inter % BLOCK or self.inter_start % BLOCK:
                raise ValueError(f"MXFP4 experts: this rank's {local_inter} intermediate columns from "
                                 f"{self.inter_start} are not whole blocks of {BLOCK}; use another tensor-parallel "
                                 "size or enable_expert_parallel")
            self.w13 = Mxfp4Experts(local_experts, 2 * local_inter, hidden)
            self.w2 = Mxfp4Experts(local_experts, hidden, local_inter)
        elif int4 is None:
            self.w13 = nn.Parameter(torch.empty(local_experts, 2 * local_inter, hidden))
            self.w2 = nn.Parameter(torch.empty(local_experts, hidden, local_inter))
        else:  # whole experts only: the models refuse tensor parallelism with quantized weights
            self.w13 = Int4Experts(local_experts, 2 * local_inter, hidden, int4)
            self.w2 = Int4Experts(local_experts, hidden, local_inter, int4)
        # biases: gate|up sliced as w13's rows; down's added by one rank of a split intermediate size
        self.b13 = nn.Parameter(torch.empty(local_experts, 2 * local_inter)) if biased else None
        self.b2 = nn.Parameter(torch.empty(local_experts, hidden)) if biased else None
        self.owns_down_bias = tp.expert_parallel or tp.rank == 0
        # tokens routed to each expert so far (every expert: each rank routes every token)
        self.register_buffer("expert_tokens", torch.zeros(num_experts, dtype=torch.int64), persistent=False)

    def experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                all_routed: bool = False, summed: bool = True) -> torch.Tensor:
        """This rank's experts on x; ids are local (-1: not here; `all_routed`: none is). Fused and
        not `summed`: each token's k weighted expert rows, [T, k, H] (fused_experts)."""
        if self.fused:
            from expresslane.layers.fused_moe import fused_experts
            return fused_experts(x, self.w13, self.w2, weights, ids, all_routed, summed, self.b13, self.b2, self.act)
        return torch_experts(x, self.w13, self.w2, weights, ids, self.b13, self.b2, self.act)

    def forward(self, x: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H], or on one rank with the fused kernels [T, k, H], the rows that sum
        to it (the decoder's next RMSNorm, fused, takes them); tokens with slot -1 (CUDA-graph
        padding) are not counted."""
        logits = self.gate(x)
        if self.fused:  # one kernel: softmax, top-k, renormalisation, counters
            from expresslane.layers.fused_moe import fused_route
            weights, ids = fused_route(logits, self.top_k, self.renormalize, self.expert_tokens, slot_mapping,
                                       topk_softmax=self.topk_softmax)
        else:
            weights, ids = route(logits, self.top_k, self.renormalize, self.topk_softmax)
            real = (slot_mapping >= 0).to(torch.int64)
            self.expert_tokens.scatter_add_(0, ids.flatten(), real[:, None].expand(ids.shape).flatten())
        if self.tp.expert_parallel:
            return dispatch_combine(x, weights, ids, self.experts_per_rank, self.tp, self.experts)
        if self.fused and self.tp.size == 1:  # [T, k, H]: the next layer's fused RMSNorm sums them
            return self.experts(x, weights, ids, all_routed=True, summed=False)
        return self.tp.all_reduce(self.experts(x, weights, ids, all_routed=True))

    # -- weights -------------------------------------------------------------------------------
    def load_expert(self, expert: int, part: str, name: str, tensor: torch.Tensor) -> str | None:
        """One expert's checkpoint tensor `name` ('weight', 'bias', an INT4 format's 'qweight',
        'scales', ..., or MXFP4's 'blocks' and 'scales') of part 'gate', 'up' or 'down' ([I, H], [I, H], [H, I] as float weights; [I],
        [I], [H] as biases). Returns the key it completed; None for an expert another rank holds
        or a part still awaiting tensors."""
        local = expert - self.first_expert
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} out of range: the model has {self.num_experts}")
        if not 0 <= local < self.w13.shape[0]:
            return None
        hidden, n = self.w2.shape[1], self.w2.shape[2]
        if isinstance(self.w13, Int4Experts):
            family, start = (self.w2, 0) if part == "down" else (self.w13, 0 if part == "gate" else n)
            width = hidden if part == "down" else n
            return f"{local}.{part}" if family.load(local, slice(start, start + width), name, tensor) else None
        if isinstance(self.w13, Mxfp4Experts) and name in ("blocks", "scales"):
            if part == "down":  # [H, I/32(, 16)]: this rank's blocks of the intermediate size
                done = self.w2.load(local, slice(0, hidden), name, tensor.narrow(1, self.inter_start // BLOCK,
                                                                                 n // BLOCK))
            else:
                offset = 0 if part == "gate" else n
                done = self.w13.load(local, slice(offset, offset + n), name, tensor.narrow(0, self.inter_start, n))
            return f"{local}.{part}" if done else None
        if name == "bias" and self.b13 is not None:
            return self._load_bias(local, expert, part, tensor)
        if name != "weight":
            raise ValueError(f"checkpoint tensor {name!r} of expert {expert} {part}: the model's experts are not "
                             "quantized (expected 'weight')")
        full = (hidden, self.intermediate) if part == "down" else (self.intermediate, hidden)
        if tuple(tensor.shape) != full:
            raise ValueError(f"expert {expert} {part} tensor of shape {tuple(tensor.shape)}; the model's is {full}")
        if part == "down":
            self.w2.data[local].copy_(tensor.narrow(1, self.inter_start, n))
        else:
            offset = 0 if part == "gate" else n
            self.w13.data[local, offset:offset + n].copy_(tensor.narrow(0, self.inter_start, n))
        return f"{local}.{part}"

    def _load_bias(self, local: int, expert: int, part: str, tensor: torch.Tensor) -> str:
        full = self.w2.shape[1] if part == "down" else self.intermediate
        if tuple(tensor.shape) != (full,):
            raise ValueError(f"expert {expert} {part} bias of shape {tuple(tensor.shape)}; the model's is {(full,)}")
        if part == "down":
            self.b2.data[local].copy_(tensor if self.owns_down_bias else torch.zeros_like(tensor))
        else:
            n = self.w2.shape[2]
            offset = 0 if part == "gate" else n
            self.b13.data[local, offset:offset + n].copy_(tensor.narrow(0, self.inter_start, n))
        return f"{local}.{part}.bias"

    def expected_keys(self) -> set[str]:
        parts = ("gate", "up", "down")
        keys = {f"{e}.{p}" for e in range(self.w13.shape[0]) for p in parts}
        if self.b13 is not None:
            keys |= {f"{e}.{p}.bias" for e in range(self.w13.shape[0]) for p in parts}
        return keys
