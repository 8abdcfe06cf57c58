"""Fused elementwise kernels for the `triton` backend: RMSNorm (+ residual add) and
SiLU-and-mul (RoPE is fused with the KV-cache write: attention/triton_kernels.py). Each rounds where transformers rounds (to the activation dtype after
the residual add, after the normalisation and after the SiLU), so bf16 results match
the reference path bit for bit up to the order of the variance sum."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def _pow2(n: int) -> int:
    return 1 << (max(n, 1) - 1).bit_length()


@triton.jit
def _rmsnorm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, stride_x, stride_r, stride_o, n, eps,
                    HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK)
    m = i < n
    x = tl.load(x_ptr + row * stride_x + i, mask=m, other=0.0)
    if HAS_RES:
        x = x + tl.load(res_ptr + row * stride_r + i, mask=m, other=0.0)
        tl.store(res_out_ptr + row * n + i, x, mask=m)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, 0) / n
    y = (xf * tl.math.rsqrt(var + eps)).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + i, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + i, (w * y).to(out_ptr.dtype.element_ty), mask=m)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """Like RMSNorm.forward: norm(x), or (norm(x + residual), x + residual)."""
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(out) if residual is not None else out
    r2 = residual.reshape(-1, n) if residual is not None else x2
    _rmsnorm_kernel[(x2.shape[0],)](x2, r2, weight, out, res_out, x2.stride(0), r2.stride(0), out.stride(0), n, eps,
                                    HAS_RES=residual is not None, BLOCK=_pow2(n), num_warps=4 if n <= 4096 else 8)
    if residual is None:
        return out.view(x.shape)
    return out.view(x.shape), res_out.view(x.shape)


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, stride_x, n, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    g = tl.load(x_ptr + row * stride_x + i, mask=m, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + n + i, mask=m, other=0.0)
    silu = (g / (1.0 + tl.exp(-g))).to(u.dtype).to(tl.float32)
    tl.store(out_ptr + row * n + i, (silu * u.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=m)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    rows, n = gate_up.shape[0], gate_up.shape[-1] // 2
    out = torch.empty(rows, n, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, _pow2(n))
    _silu_mul_kernel[(rows, triton.cdiv(n, block))](gate_up, out, gate_up.stride(0), n, BLOCK=block)
    return out
