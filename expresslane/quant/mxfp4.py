"""MXFP4 (OCP microscaling FP4), as gpt-oss ships its experts: per projection two tensors,

    *_blocks  uint8 [..., N, K / 32, 16]: 32 FP4 e2m1 values a block, two a byte, the even
              element in the low nibble
    *_scales  uint8 [..., N, K / 32]: each block's e8m0 exponent, scale = 2^(s - 127)

e2m1 nibble: sign (bit 3), exponent (bits 2-1, bias 1), mantissa (bit 0); exponent 0 is
subnormal (0 or 0.5). The magnitudes: 0, 0.5, 1, 1.5, 2, 3, 4, 6.
"""

from __future__ import annotations

import torch
from torch import nn

BLOCK = 32  # values per scale


def e2m1_values(dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> torch.Tensor:
    """The 16 values of the FP4 e2m1 codes, indexed by the nibble."""
    code = torch.arange(16)
    exp, mant = (code >> 1) & 3, (code & 1).float()
    magnitude = torch.where(exp == 0, mant * 0.5, (1.0 + mant * 0.5) * torch.exp2(exp.float() - 1))
    return torch.where(code >= 8, -magnitude, magnitude).to(dtype=dtype, device=device)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., N, G, 16] packed codes and [..., N, G] exponents -> [..., N, G * 32] in `dtype`
    (exact: every value is a power of two times a code's value, within dtype's range)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1] != BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks of shape {tuple(blocks.shape)} do not fit scales of shape "
                         f"{tuple(scales.shape)} (expected blocks [..., N, G, 16], scales [..., N, G])")
    table = e2m1_values(torch.float32, blocks.device)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2).long()  # [..., G, 32], even first
    values = table[codes] * torch.exp2(scales.float() - 127.0)[..., None]
    return values.flatten(-2).to(dtype)


class Mxfp4Experts(nn.Module):
    """One projection family of a SparseMoE's experts kept in MXFP4 as shipped, one slice per
    expert: ``blocks`` uint8 [E, N, K/2] (the checkpoint's [N, K/32, 16] flattened), ``scales``
    uint8 [E, N, K/32]. The fused grouped GEMMs decode them inside the kernel; indexing
    (``experts[e]``) gives expert e's float32 weight [N, K] for the torch reference path."""

    def __init__(self, num_experts: int, n: int, k: int):
        super().__init__()
        if k % BLOCK:
            raise ValueError(f"MXFP4 experts: {k} inputs do not split into blocks of {BLOCK}")
        self.n, self.k = n, k
        self.blocks = nn.Parameter(torch.zeros(num_experts, n, k // 2, dtype=torch.uint8), requires_grad=False)
        self.scales = nn.Parameter(torch.zeros(num_experts, n, k // BLOCK, dtype=torch.uint8), requires_grad=False)
        self._pending: dict[tuple[int, int], set[str]] = {}

    @property
    def shape(self) -> tuple[int, int, int]:
        """(E, N, K), as a stacked float weight's."""
        return self.blocks.shape[0], self.n, self.k

    def load(self, expert: int, rows: slice, name: str, tensor: torch.Tensor) -> bool:
        """The checkpoint's `blocks` [n, K/32, 16] or `scales` [n, K/32] of `expert`'s output
        `rows`; True once both have arrived."""
        target = {"blocks": self.blocks, "scales": self.scales}.get(name)
        if target is None:
            raise ValueError(f"checkpoint tensor {name!r} is not part of an MXFP4 expert (expected blocks, scales)")
        want = (rows.stop - rows.start, self.k // BLOCK) + ((BLOCK // 2,) if name == "blocks" else ())
        if tuple(tensor.shape) != want or tensor.dtype != torch.uint8:
            raise ValueError(f"MXFP4 expert {expert} {name}: {tensor.dtype} {tuple(tensor.shape)}; expected uint8 "
                             f"{want}")
        target.data[expert, rows].copy_(tensor.reshape(want[0], -1))
        seen = self._pending.setdefault((expert, rows.start), set())
        seen.add(name)
        if len(seen) < 2:
            return False
        del self._pending[(expert, rows.start)]
        return True

    def __getitem__(self, expert: int) -> torch.Tensor:
        """Expert `expert`'s weight, float32 [N, K]."""
        return dequantize_mxfp4(self.blocks[expert].view(self.n, -1, BLOCK // 2), self.scales[expert], torch.float32)
