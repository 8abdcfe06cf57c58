"""RMSNorm, with the residual add folded in (one fused Triton pass instead of ~6 kernels
when `fused`: the model turns it on with the `triton` attention backend)."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    offset = False  # scaled by w (GemmaRMSNorm: by 1 + w); the attention kernel's q/k norm reads it

    def __init__(self, size: int, eps: float = 1e-6, fused: bool = False, fp8_out: bool = False):
        """`fp8_out` (fused only): the norm feeds an FP8 linear layer, so the kernel also quantizes
        it per token and returns an Fp8Activation (quant/fp8.py) in place of the tensor."""
        super().__init__()
        if fp8_out and not fused:
            raise ValueError("RMSNorm quantizes its output only in the fused Triton kernel")
        self.eps = eps
        self.fused = fused
        self.fp8_out = fp8_out
        self.weight = nn.Parameter(torch.ones(size))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without `residual`: norm(x). With it: (norm(x + residual), x + residual); fused, x may
        then come in parts [T, P, n] that sum to it (the fused MoE's per-expert rows)."""
        if self.fused:
            from expresslane.layers.triton_ops import rms_norm
            return rms_norm(x, self.weight, self.eps, residual, self.fp8_out)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
