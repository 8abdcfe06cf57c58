"""Tensor-parallel layers: each rank holds a slice of a weight and loads only that slice.

    column-parallel  y[:, mine] = x @ W[mine, :]^T          (q|k|v, gate|up: no communication)
    row-parallel     y = all_reduce(x[:, mine] @ W[:, mine]^T) + b   (o_proj, down_proj)
    vocab-parallel   embedding rows [mine]: lookup, zero elsewhere, all_reduce;
                     LM head rows [mine]: local logits, all_gather along the vocabulary

They subclass the plain torch modules, so a model built with them runs the same code as
without. Every layer owns a ``load(part, tensor, shard)`` weight loader that cuts its
slice out of the full checkpoint tensor: what a rank keeps is only its share.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from expresslane.distributed.group import TPGroup


def head_split(num_heads: int, num_kv_heads: int, tp: TPGroup) -> tuple[int, int, int, int]:
    """(q heads here, first q head, kv heads here, first kv head). Query heads split evenly;
    KV heads split too, or, with fewer KV heads than ranks, each rank keeps the one KV head
    its query heads read (ranks r*tp/kv .. (r+1)*tp/kv - 1 share KV head r)."""
    if num_heads % tp.size:
        raise ValueError(f"tensor_parallel_size {tp.size} must divide the model's {num_heads} attention heads")
    if num_kv_heads % tp.size and tp.size % num_kv_heads:
        raise ValueError(f"tensor_parallel_size {tp.size} and the model's {num_kv_heads} KV heads: one must "
                         "divide the other")
    q = num_heads // tp.size
    if num_kv_heads >= tp.size:
        kv = num_kv_heads // tp.size
        return q, tp.rank * q, kv, tp.rank * kv
    return q, tp.rank * q, 1, tp.rank // (tp.size // num_kv_heads)


def even_split(size: int, tp: TPGroup, what: str) -> tuple[int, int]:
    """(start, length) of this rank's equal share of `size`."""
    if size % tp.size:
        raise ValueError(f"tensor_parallel_size {tp.size} must divide the model's {what} ({size})")
    n = size // tp.size
    return tp.rank * n, n


class ColumnParallelLinear(nn.Linear):
    """A (merged) projection whose output features are split: checkpoint shard i (e.g. q, k,
    v) contributes rows ``ranges[i] = (start, length)`` of its full weight."""

    def __init__(self, in_features: int, ranges: list[tuple[int, int]], bias: bool):
        super().__init__(in_features, sum(n for _, n in ranges), bias=bias)
        self.ranges = ranges
        self.offsets = [sum(n for _, n in ranges[:i]) for i in range(len(ranges))]

    def load(self, part: str, tensor: torch.Tensor, shard: int) -> None:
        start, n = self.ranges[shard]
        _copy(getattr(self, part).data.narrow(0, self.offsets[shard], n), tensor.narrow(0, start, n))


class RowParallelLinear(nn.Linear):
    """Input features split; the partial products are summed over the ranks, then the
    (unsplit) bias is added once."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup):
        self.in_start, local_in = even_split(in_features, tp, "projection inputs")
        super().__init__(local_in, out_features, bias=bias)
        self.tp = tp

    def load(self, part: str, tensor: torch.Tensor, shard: None) -> None:
        src = tensor.narrow(1, self.in_start, self.in_features) if part == "weight" else tensor
        _copy(getattr(self, part).data, src)

    def forward(self, x: torch.Tensor, add=None) -> torch.Tensor:
        """`add(partial, x)`: more of this rank's partial sum before the reduction (a LoRA delta)."""
        y = F.linear(x, self.weight)
        return self.reduce(y if add is None else add(y, x))

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """This rank's partial product -> the layer's output: summed over the ranks, then the bias."""
        y = self.tp.all_reduce(partial)
        return y if self.bias is None else y + self.bias


def _vocab_rows(vocab: int, tp: TPGroup) -> tuple[int, int]:
    """(first row, rows per rank): the vocabulary padded up to a multiple of the ranks."""
    per_rank = -(-vocab // tp.size)
    return tp.rank * per_rank, per_rank


def _load_rows(param: torch.Tensor, tensor: torch.Tensor, start: int) -> None:
    """Rows [start, start + len(param)) of `tensor`; rows past its end (padding) stay zero."""
    n = max(0, min(param.shape[0], tensor.shape[0] - start))
    if tensor.shape[1:] != param.shape[1:]:
        raise ValueError(f"checkpoint tensor shape {tuple(tensor.shape)} does not fit rows of {tuple(param.shape)}")
    param.zero_()
    param[:n].copy_(tensor[start:start + n])


class VocabParallelEmbedding(nn.Embedding):
    def __init__(self, vocab: int, hidden: int, tp: TPGroup):
        self.start, per_rank = _vocab_rows(vocab, tp)
        super().__init__(per_rank, hidden)
        self.tp = tp

    def load(self, part: str, tensor: torch.Tensor, shard: None) -> None:
        _load_rows(self.weight.data, tensor, self.start)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.num_embeddings)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(x.masked_fill(outside[:, None], 0.0))


class ParallelLMHead(nn.Linear):
    """LM head rows split like the embedding (a tied head reads the embedding's rows)."""

    def __init__(self, vocab: int, hidden: int, tp: TPGroup):
        self.start, per_rank = _vocab_rows(vocab, tp)
        super().__init__(hidden, per_rank, bias=False)

    def load(self, part: str, tensor: torch.Tensor, shard: None) -> None:
        _load_rows(self.weight.data, tensor, self.start)


def gather_logits(local: torch.Tensor, vocab: int, tp: TPGroup) -> torch.Tensor:
    """[B, V/tp] on every rank -> [B, V] (padding rows dropped)."""
    return tp.all_gather(local)[:, :vocab]


def _copy(target: torch.Tensor, src: torch.Tensor) -> None:
    if target.shape != src.shape:
        raise ValueError(f"checkpoint tensor slice {tuple(src.shape)} does not fit {tuple(target.shape)}")
    target.copy_(src)
