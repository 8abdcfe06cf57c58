"""QuantLinear: a linear layer whose weights and matmul belong to a quantization method.

A merged projection (q|k|v, gate|up) is loaded shard by shard; each shard arrives as
several checkpoint tensors (``qweight``, ``scales``, ...), in any order. The layer keeps
them until its last required tensor arrives, then hands all shards to the method, which
builds the stored weights (so at most one layer's raw tensors are held at a time).
"""

from __future__ import annotations

import torch
from torch import nn


class QuantLinear(nn.Module):
    def __init__(self, in_features: int, shard_sizes: list[int], bias: bool, method):
        super().__init__()
        self.in_features = in_features
        self.shard_sizes = shard_sizes
        self.out_features = sum(shard_sizes)
        self.method = method
        self.bias = nn.Parameter(torch.zeros(self.out_features), requires_grad=False) if bias else None
        self.device = torch.get_default_device()
        self.dtype = torch.get_default_dtype()
        self._parts: list[dict[str, torch.Tensor]] | None = [{} for _ in shard_sizes]

    @property
    def complete(self) -> bool:
        return self._parts is None

    def missing(self) -> list[str]:
        if self._parts is None:
            return []
        return [f"#{i}.{name}" for i, p in enumerate(self._parts) for name in self.method.required if name not in p]

    def load_part(self, shard: int, name: str, tensor: torch.Tensor) -> None:
        if name in self.method.ignored:
            return
        if name not in self.method.required:
            raise ValueError(f"checkpoint tensor {name!r} is not part of a {self.method.name} linear layer "
                             f"(expected {', '.join(self.method.required)})")
        if self._parts is None:
            raise ValueError(f"checkpoint tensor {name!r} arrives twice for one {self.method.name} layer")
        self._parts[shard][name] = tensor
        if not self.missing():
            parts, self._parts = self._parts, None
            self.method.build(self, parts)
            n, k = self.method.shape(self)
            if (n, k) != (self.out_features, self.in_features):
                raise ValueError(f"{self.method.name} weights of shape {(n, k)} do not fit a linear layer of "
                                 f"{self.in_features} inputs and {self.out_features} outputs")

    def dequantized_weight(self) -> torch.Tensor:
        """float32 [out, in]: the weight the quantized one stands for (tests, accuracy reports)."""
        return self.method.dequantized(self)

    def forward(self, x) -> torch.Tensor:
        """x: a tensor, or for an FP8 layer an Fp8Activation (its input quantized by its producer)."""
        return self.method.apply(self, x)
