"""Triton kernels of the quantized linear layers (GPU path; the Triton interpreter on CPU tests).

``quant_gemm_kernel`` computes ``out[M, N] = x[M, K] @ W[N, K]^T (+ bias)`` with W stored
quantized and dequantized tile by tile in registers, never in memory:

- FP8 (W8A8): W is float8_e4m3 [N, K] with one float32 scale per output channel. Each
  program first finds its rows' absolute maxima over K (x is small and stays in cache),
  then quantizes every x tile to e4m3 values on the fly with that per-token scale, exactly
  as ``per_token_quant_fp8`` does. e4m3 values are exact in bf16/fp16/fp32, so the dot of
  the two quantized tiles in the activation dtype with float32 accumulation equals the FP8
  tensor-core product up to summation order; both scales apply once, in the epilogue.
- INT4 (W4A16): W is stored transposed and packed, ``qweight[K // 8, N]`` int32, nibble j
  of row r holding input k = 8r + j (GPTQ's order), with per-group (GROUP inputs) scales
  and zero points ``[K // GROUP, N]``: ``w[k, n] = (q - zero) * scale``, computed in
  float32 and rounded to the activation dtype before the dot. A K tile loads BLOCK_K / 8
  packed rows once and unpacks each into its 8 inputs. BLOCK_K divides GROUP, so a K tile
  belongs to one group and loads one row of scales and zeros.

``per_token_quant_fp8`` is the separate quantization of an FP8 linear's input (before the
decode GEMV, or ``torch._scaled_mm`` for long inputs, where cuBLAS's FP8 GEMM beats a Triton
tile loop), unless the kernel that produced the input quantized it already
(layers/triton_ops.py, the same arithmetic: ``_quantize_e4m3``).
"""

from __future__ import annotations

import torch

from expresslane.triton_setup import tl, triton

# 448.0 = largest finite e4m3 and 1e-12 = the scale floor, as in fp8.py (FP8_MAX, SCALE_EPS)

@triton.jit
def _quantize_e4m3(x, scale):
    """x / scale clamped to +-448 and rounded to the nearest e4m3 value (ties to even), as float32.

    The rounding is arithmetic: adding and subtracting 1.5 * 2^(s + 23) rounds to a multiple of
    2^s, with s = exponent - 3 (3 mantissa bits; exponent >= -6, the subnormal step is 2^-9).
    It equals torch's float32 -> float8_e4m3fn conversion, and the value then converts exactly;
    the Triton interpreter's own conversion drops the carry when rounding up to a power of two."""
    v = tl.minimum(tl.maximum(tl.div_rn(x, scale), -448.0), 448.0)
    e = tl.maximum(((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
    magic = (((e - 3 + 127 + 23) << 23) | 0x400000).to(tl.float32, bitcast=True)
    return (v + magic) - magic


@triton.jit
def quant_gemm_kernel(x_ptr, w_ptr, scale_ptr, zero_ptr, bias_ptr, out_ptr, M, N, K,
                      stride_xm, stride_om,
                      FP8: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    rk0 = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
    if FP8:
        amax = tl.zeros([BLOCK_M], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + rk0
            x = tl.load(x_rows + rk[None, :], mask=m_ok[:, None] & (rk[None, :] < K), other=0.0)
            amax = tl.maximum(amax, tl.max(tl.abs(x.to(tl.float32)), 1))
        x_scale = tl.maximum(amax, 1e-12) / 448.0
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + rk0
        k_ok = rk < K
        x = tl.load(x_rows + rk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        if FP8:
            x = _quantize_e4m3(x.to(tl.float32), x_scale[:, None]).to(x.dtype)  # exact in 16 bits
            w = tl.load(w_ptr + rn.to(tl.int64)[None, :] * K + rk[:, None], mask=n_ok[None, :] & k_ok[:, None],
                        other=0.0)
            w = w.to(x.dtype)
        else:
            # BLOCK_K / 8 packed rows, each unpacked into 8 inputs: [BK/8, 8, BN] -> [BK, BN]
            rp = k0 // 8 + tl.arange(0, BLOCK_K // 8)
            packed = tl.load(w_ptr + rp[:, None] * N + rn[None, :], mask=n_ok[None, :] & (rp < K // 8)[:, None],
                             other=0)
            # nibble | 0x4B000000 is the float 2^23 + q: no int->float conversions (a quarter-rate op)
            q = ((packed[:, None, :] >> (tl.arange(0, 8) * 4)[None, :, None]) & 0xF) | 0x4B000000
            q = tl.reshape(q, (BLOCK_K, BLOCK_N)).to(tl.float32, bitcast=True)
            g = k0 // GROUP
            s = tl.load(scale_ptr + g * N + rn, mask=n_ok, other=0.0).to(tl.float32)
            z = tl.load(zero_ptr + g * N + rn, mask=n_ok, other=0).to(tl.float32) + 8388608.0
            w = ((q - z[None, :]) * s[None, :]).to(x.dtype)
        acc += tl.dot(x, w, input_precision=PRECISION)
    if FP8:
        w_scale = tl.load(scale_ptr + rn, mask=n_ok, other=0.0)
        acc = acc * x_scale[:, None] * w_scale[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    o = out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
    tl.store(o, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def int4_dequant_kernel(qw_ptr, scale_ptr, zero_ptr, out_ptr, K, N, GROUP: tl.constexpr,
                        BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    """qweight [K / 8, N] -> out [K, N] in out's dtype: w = (q - z) * s in float32, rounded once
    (what quant_gemm_kernel feeds its dot). A packed row's 8 inputs share a group (8 | GROUP)."""
    rp = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = (rp < K // 8)[:, None] & (rn < N)[None, :]
    packed = tl.load(qw_ptr + rp.to(tl.int64)[:, None] * N + rn[None, :], mask=ok, other=0)
    zs = ((rp * 8) // GROUP).to(tl.int64)[:, None] * N + rn[None, :]
    z = tl.load(zero_ptr + zs, mask=ok, other=0).to(tl.float32) + 8388608.0
    s = tl.load(scale_ptr + zs, mask=ok, other=0.0).to(tl.float32)
    for j in tl.static_range(8):
        q = (((packed >> (4 * j)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True)
        o = out_ptr + (rp.to(tl.int64) * 8 + j)[:, None] * N + rn[None, :]
        tl.store(o, ((q - z) * s).to(out_ptr.dtype.element_ty), mask=ok)


def int4_dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int,
                    dtype: torch.dtype) -> torch.Tensor:
    """The W4A16 weight as a dense [K, N] tensor of ``dtype`` (long inputs: then one cuBLAS GEMM)."""
    k8, n = qweight.shape
    out = torch.empty((k8 * 8, n), dtype=dtype, device=qweight.device)
    int4_dequant_kernel[(triton.cdiv(k8, 16), triton.cdiv(n, 256))](
        qweight, scales, zeros, out, k8 * 8, n, GROUP=group, BLOCK_R=16, BLOCK_N=256, num_warps=4)
    return out


@triton.jit
def per_token_quant_fp8_kernel(x_ptr, q_ptr, scale_ptr, K, stride_xm, BLOCK: tl.constexpr, ONE_PASS: tl.constexpr):
    """One program per row: scale = max|x| / 448, q = e4m3(x / scale). ONE_PASS (K <= BLOCK):
    the row is read once (decode-sized inputs: this kernel's latency is on the critical path)."""
    row = tl.program_id(0).to(tl.int64)
    if ONE_PASS:
        k = tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_xm + k, mask=k < K, other=0.0).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(x), 0), 1e-12) / 448.0
        tl.store(q_ptr + row * K + k, _quantize_e4m3(x, scale).to(tl.float8e4nv), mask=k < K)
    else:
        amax = tl.zeros([BLOCK], tl.float32)
        for k0 in range(0, K, BLOCK):
            k = k0 + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + row * stride_xm + k, mask=k < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.maximum(tl.max(amax, 0), 1e-12) / 448.0
        for k0 in range(0, K, BLOCK):
            k = k0 + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + row * stride_xm + k, mask=k < K, other=0.0).to(tl.float32)
            tl.store(q_ptr + row * K + k, _quantize_e4m3(x, scale).to(tl.float8e4nv), mask=k < K)
    tl.store(scale_ptr + row, scale)


def per_token_quant_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], float32 scales [M, 1])."""
    m, k = x.shape
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m:
        one_pass = k <= 16384 and m <= 64  # few long rows: one read each; many rows: the GPU is full anyway
        block = triton.next_power_of_2(k) if one_pass else min(4096, triton.next_power_of_2(k))
        per_token_quant_fp8_kernel[(m,)](x, q, scale, k, x.stride(0), BLOCK=block, ONE_PASS=one_pass,
                                         num_warps=8 if block > 4096 else 4)
    return q, scale


def _tiles(m: int, group: int | None, n: int = 4096) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps) by the number of rows: decode-sized inputs are
    weight-bandwidth bound (narrow N tiles: 128+ programs for N = 4096, about one per SM),
    long ones compute bound."""
    if m <= 16:
        bm, bn, bk, warps = 16, 32 if n <= 8192 else 64, 128, 4
    elif m <= 64:
        bm, bn, bk, warps = 64, 64, 64, 4
    else:
        bm, bn, bk, warps = 128, 128, 64, 8
    if group is not None:
        bk = min(bk, group)
    return bm, bn, bk, warps


def quant_gemm(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
               bias: torch.Tensor | None, n: int, group: int | None) -> torch.Tensor:
    """x [M, K] (activation dtype, last dim contiguous) -> [M, n]. FP8 when ``group`` is None
    (w e4m3 [n, K], scale [n]); INT4 otherwise (w packed [K // 8, n], scale/zero [K // group, n])."""
    m, k = x.shape
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    bm, bn, bk, warps = _tiles(m, group, n)
    fp8 = group is None
    if not fp8 and group % bk:
        raise ValueError(f"group size {group} is not a multiple of the K tile {bk}")
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    quant_gemm_kernel[grid](
        x, w, scale, zero if zero is not None else scale, bias if bias is not None else scale, out, m, n, k,
        x.stride(0), out.stride(0), FP8=fp8, GROUP=group or 1, HAS_BIAS=bias is not None,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=3 if m > 16 else 4)
    return out
