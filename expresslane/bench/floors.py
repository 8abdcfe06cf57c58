"""Physical limits that measurements are judged against, and what a decode step must read. Shared by ``bench one-batch`` and the GPU profiling scripts."""

from __future__ import annotations

from torch import nn

from expresslane.layers.moe import SparseMoE

H200_PEAK_BANDWIDTH = 4.27e12  # B/s: a device-to-device copy measured on one H200
H200_PEAK_FLOPS = 805e12  # FLOP/s: bf16 matmul on one H200


def decode_weight_bytes(model: nn.Module, batch: int = 1) -> int:
    """Bytes of weights one decode step of `batch` tokens reads: every weight, except an
    embedding table of which it gathers a few rows (a tied table is read whole, as the output
    projection). A mixture of experts reads only the experts its tokens are routed to: the
    share 1 - (1 - k/E)^batch of them expected under uniform routing (k/E at batch 1: the
    active parameters)."""
    tied = getattr(model, "tie_word_embeddings", False)
    tables = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    gathered = set() if tied else tables
    share = {id(p): 1 - (1 - m.top_k / m.num_experts) ** batch
             for m in model.modules() if isinstance(m, SparseMoE) for w in (m.w13, m.w2)
             for p in (w.parameters() if isinstance(w, nn.Module) else (w,))}  # INT4 experts: a module
    return int(sum(p.numel() * p.element_size() * share.get(id(p), 1.0) for p in model.parameters()
                   if id(p) not in gathered))
