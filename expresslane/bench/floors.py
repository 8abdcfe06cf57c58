"""Physical limits that measurements are judged against (one H200), and what a decode
step must read. Shared by ``bench one-batch`` and the GPU profiling scripts."""

from __future__ import annotations

from torch import nn

H200_PEAK_BANDWIDTH = 4.27e12  # B/s: a device-to-device copy measured on one H200
H200_PEAK_FLOPS = 805e12  # FLOP/s: bf16 matmul on one H200


def decode_weight_bytes(model: nn.Module) -> int:
    """Bytes of weights one decode step reads: every weight, except an embedding table of
    which it gathers a few rows (a tied table is read whole, as the output projection)."""
    tied = getattr(model, "tie_word_embeddings", False)
    tables = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    gathered = set() if tied else tables
    return sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in gathered)
