"""Fused elementwise kernels for the `triton` backend: RMSNorm (+ residual add; Gemma's
(1 + w) form too, and its post-norm of the sublayer's output before the add) and SiLU-and-mul
(or GeGLU's gelu-and-mul); RoPE is fused with the KV-cache write (attention/triton_kernels.py). Each rounds where transformers rounds (to the activation
dtype after the residual add, after the normalisation and after the activation), so bf16 results
match the reference path bit for bit up to the order of the variance sum.

For an FP8 (W8A8) consumer (`fp8_out`), a program that holds a whole output row also
quantizes it per token: scale = max|y| / 448 of the rounded output y, q = e4m3(y / scale),
the very arithmetic of ``per_token_quant_fp8`` on the stored row (bit for bit), so the
linear layer skips that launch. It returns an ``Fp8Activation``."""

from __future__ import annotations

import torch

from expresslane.quant.fp8 import Fp8Activation
from expresslane.quant.kernels import _quantize_e4m3
from expresslane.triton_setup import rows_per_program, tl, triton

FP8_ROWS = 64  # SiLU-and-mul quantizes its output for up to this many rows (whole rows a program)
FP8_WIDTH = 16384  # ... of up to this many outputs (a row in registers, as per_token_quant_fp8's one pass)


def _pow2(n: int) -> int:
    return 1 << (max(n, 1) - 1).bit_length()


@triton.jit
def _store_fp8_rows(y, q_ptr, scale_ptr, r, i, m, rm, n):
    """Quantize whole output rows y [ROWS, BLOCK] (float32 of the stored, rounded values; 0 off
    the row) of rows r [ROWS, 1]."""
    scale = tl.maximum(tl.max(tl.abs(y), 1), 1e-12)[:, None] / 448.0
    tl.store(q_ptr + r * n + i, _quantize_e4m3(y, scale).to(tl.float8e4nv), mask=m)
    tl.store(scale_ptr + r, scale, mask=rm)


@triton.jit
def _rmsnorm_kernel(x_ptr, res_ptr, w_ptr, pre_w_ptr, out_ptr, res_out_ptr, q_ptr, scale_ptr, stride_x, stride_r,
                    stride_o, n, num_rows, eps, HAS_RES: tl.constexpr, FP8_OUT: tl.constexpr, BLOCK: tl.constexpr,
                    PARTS: tl.constexpr, OFFSET: tl.constexpr, PRE_NORM: tl.constexpr, ROWS: tl.constexpr):
    """ROWS rows a program. PARTS > 1: x's row holds that many rows of n to sum first (a token's
    experts), in float32 and rounded once, as torch's sum of them. OFFSET: Gemma's norm,
    x / rms(x) * (1 + w) in float32, rounded once. PRE_NORM (with OFFSET): x is first normalised
    so by its own weights pre_w (Gemma's post-attention norm), rounded, then added to the residual."""
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None]
    rm = r < num_rows
    i = tl.arange(0, BLOCK)[None, :]
    m = rm & (i < n)
    if PARTS > 1:
        acc = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
        for p in tl.static_range(PARTS):
            acc += tl.load(x_ptr + r * stride_x + p * n + i, mask=m, other=0.0).to(tl.float32)
        x = acc.to(x_ptr.dtype.element_ty)
    else:
        x = tl.load(x_ptr + r * stride_x + i, mask=m, other=0.0)
    if PRE_NORM:
        pf = x.to(tl.float32)
        pre_w = tl.load(pre_w_ptr + i, mask=i < n, other=0.0).to(tl.float32)
        pre_r = tl.math.rsqrt(tl.sum(pf * pf, 1)[:, None] / n + eps)
        x = (pf * pre_r * (1.0 + pre_w)).to(x.dtype)
    if HAS_RES:
        x = x + tl.load(res_ptr + r * stride_r + i, mask=m, other=0.0)
        tl.store(res_out_ptr + r * n + i, x, mask=m)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, 1)[:, None] / n
    w = tl.load(w_ptr + i, mask=i < n, other=0.0).to(tl.float32)
    if OFFSET:
        out = (xf * tl.math.rsqrt(var + eps) * (1.0 + w)).to(out_ptr.dtype.element_ty)
    else:
        y = (xf * tl.math.rsqrt(var + eps)).to(x.dtype).to(tl.float32)
        out = (w * y).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + r * stride_o + i, out, mask=m)
    if FP8_OUT:
        _store_fp8_rows(out.to(tl.float32), q_ptr, scale_ptr, r, i, m, rm, n)


def _fp8_buffers(rows: int, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty((rows, n), dtype=torch.float8_e4m3fn, device=device),
            torch.empty((rows, 1), dtype=torch.float32, device=device))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             fp8_out: bool = False, offset: bool = False, pre_weight: torch.Tensor | None = None):
    """Like RMSNorm.forward: norm(x), or (norm(x + residual), x + residual); with `fp8_out`
    (x [T, n]) the norm comes as an Fp8Activation. With a residual, x may be [T, P, n]: P parts
    of each row (the fused MoE's rows of a token's experts), summed here first. `offset`: scaled
    by (1 + weight), as GemmaRMSNorm. `pre_weight` (offset, a residual, x [T, n]): x is Gemma's
    sublayer output, normalised by (1 + pre_weight) before the add: one pass for two norms."""
    if pre_weight is not None and not (offset and residual is not None and x.shape == residual.shape):
        raise ValueError("pre_weight needs offset=True and a residual of x's shape")
    n = x.shape[-1]
    parts = x.shape[-2] if residual is not None and x.dim() == residual.dim() + 1 else 1
    shape = residual.shape if parts > 1 else x.shape
    x2 = x.reshape(-1, parts * n)
    out = torch.empty(x2.shape[0], n, dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(out) if residual is not None else out
    r2 = residual.reshape(-1, n) if residual is not None else x2
    q, scale = _fp8_buffers(x2.shape[0], n, x.device) if fp8_out else (out, out)
    rows = x2.shape[0]
    per = rows_per_program(rows)
    _rmsnorm_kernel[(triton.cdiv(rows, per),)](x2, r2, weight, weight if pre_weight is None else pre_weight, out,
                                               res_out, q, scale, x2.stride(0), r2.stride(0), out.stride(0), n, rows,
                                               eps, HAS_RES=residual is not None, FP8_OUT=fp8_out, BLOCK=_pow2(n),
                                               PARTS=parts, OFFSET=offset, PRE_NORM=pre_weight is not None, ROWS=per,
                                               num_warps=4 if n <= 4096 else 8)
    normed = Fp8Activation(out, q, scale) if fp8_out else out.view(shape)
    return normed if residual is None else (normed, res_out.view(shape))


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, q_ptr, scale_ptr, stride_x, n, num_rows, FP8_OUT: tl.constexpr,
                     BLOCK: tl.constexpr, GELU: tl.constexpr, ROWS: tl.constexpr):
    """Rows from program_id(0) * ROWS, outputs from program_id(1) * BLOCK; FP8_OUT: whole rows
    (BLOCK >= n). GELU: GeGLU, gelu with the tanh approximation (Gemma's gelu_pytorch_tanh) in
    place of SiLU."""
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None]
    rm = r < num_rows
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)[None, :]
    m = rm & (i < n)
    g = tl.load(x_ptr + r * stride_x + i, mask=m, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + r * stride_x + n + i, mask=m, other=0.0)
    if GELU:  # 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))), tanh(z) = 1 - 2 / (e^2z + 1)
        z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        act = (0.5 * g * (2.0 - 2.0 / (tl.exp(2.0 * z) + 1.0))).to(u.dtype).to(tl.float32)
    else:
        act = (g / (1.0 + tl.exp(-g))).to(u.dtype).to(tl.float32)
    out = (act * u.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + r * n + i, out, mask=m)
    if FP8_OUT:
        _store_fp8_rows(out.to(tl.float32), q_ptr, scale_ptr, r, i, m, rm, n)


def silu_and_mul(gate_up: torch.Tensor, fp8_out: bool = False, gelu: bool = False) -> torch.Tensor | Fp8Activation:
    """SwiGLU of gate_up [T, 2n] -> [T, n] (`gelu`: GeGLU). With `fp8_out`, decode-sized inputs
    (T <= FP8_ROWS, n <= FP8_WIDTH) come as an Fp8Activation, one program per row; longer ones
    are tiled over the row and come plain (their consumer quantizes them)."""
    rows, n = gate_up.shape[0], gate_up.shape[-1] // 2
    out = torch.empty(rows, n, dtype=gate_up.dtype, device=gate_up.device)
    fp8_out = fp8_out and rows <= FP8_ROWS and n <= FP8_WIDTH
    if fp8_out:
        q, scale = _fp8_buffers(rows, n, gate_up.device)
        block = _pow2(n)
        warps = 16 if block > 8192 else 8 if block > 2048 else 4
    else:
        q = scale = out
        block, warps = min(1024, _pow2(n)), 4
    per = rows_per_program(rows)
    _silu_mul_kernel[(triton.cdiv(rows, per), triton.cdiv(n, block))](gate_up, out, q, scale, gate_up.stride(0), n,
                                                                       rows, FP8_OUT=fp8_out, BLOCK=block, GELU=gelu,
                                                                       ROWS=per, num_warps=warps)
    return Fp8Activation(out, q, scale) if fp8_out else out
