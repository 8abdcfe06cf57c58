"""MXFP4 (OCP microscaling FP4), as gpt-oss ships its experts: per projection two tensors,

    *_blocks  uint8 [..., N, K / 32, 16]: 32 FP4 e2m1 values a block, two a byte, the even
              element in the low nibble
    *_scales  uint8 [..., N, K / 32]: each block's e8m0 exponent, scale = 2^(s - 127)

e2m1 nibble: sign (bit 3), exponent (bits 2-1, bias 1), mantissa (bit 0); exponent 0 is
subnormal (0 or 0.5). The magnitudes: 0, 0.5, 1, 1.5, 2, 3, 4, 6.
"""

from __future__ import annotations

import torch

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
