"""A mixture of experts' per-expert token counters, copied to the host without waiting."""

from __future__ import annotations

import torch
from torch import nn


class ExpertTokensCopy:
    """Per sparse layer, tokens per expert."""

    def __init__(self, layers: list[int], counts: torch.Tensor):
        self.layers = layers
        self._host, self._event = counts, None
        if counts.is_cuda:
            self._host = torch.empty(counts.shape, dtype=counts.dtype, pin_memory=True)
            self._host.copy_(counts, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()

    def ready(self) -> bool:
        return self._event is None or self._event.query()

    def get(self) -> dict[int, list[int]]:
        if self._event is not None:
            self._event.synchronize()
        return dict(zip(self.layers, self._host.tolist()))


def _sparse_blocks(model: nn.Module) -> list[tuple[int, nn.Module]]:
    return [(i, layer.mlp) for i, layer in enumerate(model.layers) if layer.sparse]


def copy_expert_tokens(model: nn.Module) -> ExpertTokensCopy | None:
    """None for a dense model."""
    blocks = _sparse_blocks(model)
    if not blocks:
        return None
    return ExpertTokensCopy([i for i, _ in blocks], torch.stack([block.expert_tokens for _, block in blocks]))


def reset_expert_tokens(model: nn.Module) -> None:
    for _, block in _sparse_blocks(model):
        block.expert_tokens.zero_()
