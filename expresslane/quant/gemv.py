"""Split-K Triton kernels for decode-sized inputs (1..16 rows), where a linear layer is a
weight read: ``out[M, N] = x[M, K] @ W^T (+ bias)`` with W in bf16/fp16, FP8 or INT4.

Parallelism: a grid of (N / BLOCK_N) x SPLIT programs, each streaming one N-tile of W over
one K-slice, so that a 4096 x 4096 weight still keeps every SM busy. With SPLIT > 1 each
program writes its float32 partial to a workspace and counts itself in on a per-tile
counter; the last program of a tile sums the SPLIT partials in split order (deterministic,
whoever arrives last), applies scales and bias, writes the output and resets the counter
to 0, so one launch does all of it and a CUDA graph can replay it.

- ``gemv_kernel`` (bf16 / fp8): W [N, K], K contiguous, as the A operand of a tensor-core
  dot with x^T (``swap AB``: N fills the MMA's wide side, the few rows its narrow one).
  FP8 (W8A8): x arrives quantized per token, by its producer (the fused RMSNorm and
  SiLU-and-mul kernels) or by ``per_token_quant_fp8`` here (finding max|x| inside every
  program instead measured 2.6-4x slower), the
  dot multiplies the e4m3 operands themselves (exact products), and every BLOCK_K step's
  sum is scaled and added in float32, as cuBLAS's FP8 GEMM promotes its partial sums.
- ``int4_gemv_kernel`` (W4A16, GPTQ packing ``qweight [K/8, N]``, group scales and zeros
  ``[K/G, N]``): CUDA cores, one row of x at a time (a second row re-reads the program's
  weights from L2). Nibbles become floats without int->float conversions (a quarter-rate
  op): with the nibble at bits p..p+3 (p <= 19) of a word, v = (word & (15 << p)) | 0x4B000000
  puts it in the mantissa of 2^23, float(v) = 2^23 + q 2^p exactly, and
  float(v) 2^-p - (2^(23 - p) + z) = q - z exactly. The sum over a group of (q - z) x is
  then scaled once. About three instructions per weight (mask, convert, multiply-add).
"""

from __future__ import annotations

import os

import torch

from expresslane.device import arrival_counters
from expresslane.triton_setup import tl, triton


@triton.jit
def _arrive(part_ptr, count_ptr, acc, pid_n, pid_k, M, N, rm, rn, m_ok, n_ok, SPLIT):
    """Store this program's partial acc [BLOCK_N, BLOCK_M] (float32) and count it in. Returns
    the sum over all splits, in split order, when this program is the tile's last (else
    zeros and False); the last one resets the counter."""
    part = part_ptr + rm[None, :] * N + rn[:, None]
    ok = n_ok[:, None] & m_ok[None, :]
    tl.store(part + pid_k * M * N, acc, mask=ok)
    tl.debug_barrier()  # every thread's partial is written before the (single-thread) atomic
    count = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
    last = count == SPLIT - 1
    total = tl.zeros_like(acc)
    if last:
        for s in range(SPLIT):
            total += tl.load(part + s * M * N, mask=ok, other=0.0, cache_modifier=".cg")
        tl.store(count_ptr + pid_n, 0)
    return total, last


@triton.jit
def gemv_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr, part_ptr, count_ptr,
                M, N, K, stride_xm, stride_om, SPLIT, K_SPLIT,
                FP8: tl.constexpr, DOT: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
                EVEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """W and x in the activation dtype, or (FP8) W e4m3 with per-channel scales ws and x e4m3
    [M, K] with per-row scales xs. DOT: the dot's operand dtype (``fp8`` on a GPU, ``fp32`` in
    the interpreter, which has no 8-bit floats, or for float32 activations; e4m3 values and
    their products are exact in either; ``act``: 16-bit activations). SPLIT programs share
    a tile (SPLIT_K: SPLIT > 1), each K_SPLIT inputs (a multiple of BLOCK_K)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    x_rows = x_ptr + rm[:, None] * stride_xm
    if FP8:
        w_scale = tl.load(ws_ptr + rn, mask=n_ok, other=0.0)
        scales = w_scale[:, None] * tl.load(xs_ptr + rm, mask=m_ok, other=0.0)[None, :]
    k_lo = pid_k * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        w_ptrs = w_ptr + rn.to(tl.int64)[:, None] * K + rk[None, :]
        if EVEN:
            w = tl.load(w_ptrs)
        else:
            w = tl.load(w_ptrs, mask=n_ok[:, None] & (rk < K)[None, :], other=0.0)
        x = tl.load(x_rows + rk[None, :], mask=m_ok[:, None] & (rk < K)[None, :], other=0.0)
        if FP8:
            # Hopper's FP8 MMAs keep fewer bits than float32 in their running sums: each step's
            # dot (BLOCK_K inputs) is added to the float32 accumulator here, scaled (as cuBLAS
            # promotes its FP8 sums; the product of the two scales is linear)
            if DOT == "fp8":
                acc += tl.dot(w, tl.trans(x)) * scales
            else:
                acc += tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), input_precision="ieee") * scales
        elif DOT == "fp32":
            acc = tl.dot(w, tl.trans(x), acc, input_precision="ieee")
        else:
            acc = tl.dot(w, tl.trans(x), acc)
    if SPLIT_K:
        acc, last = _arrive(part_ptr, count_ptr, acc, pid_n, pid_k, M, N, rm, rn, m_ok, n_ok, SPLIT)
    else:
        last = True
    if last:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        o = out_ptr + rm[None, :] * stride_om + rn[:, None]
        tl.store(o, acc.to(out_ptr.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])


@triton.jit
def int4_gemv_kernel(x_ptr, qw_ptr, scale_ptr, zero_ptr, bias_ptr, out_ptr, part_ptr, count_ptr,
                     M, N, K, stride_xm, stride_om, SPLIT, CHUNKS_PER_SPLIT, MAGIC,
                     GROUP: tl.constexpr, ROWS: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
                     EVEN_N: tl.constexpr, BLOCK_N: tl.constexpr):
    """A chunk is ROWS packed rows (8 * ROWS inputs, inside one group: ROWS divides GROUP / 8);
    split pid_k takes chunks [pid_k * CHUNKS_PER_SPLIT, ...). Each thread holds every row of
    its columns, so the sums over rows stay in registers. MAGIC = 0x4B000000, passed at run
    time: in a register it lets mask-and-or be one LOP3 (one immediate operand per op)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    rr = tl.arange(0, ROWS)
    c_lo = pid_k * CHUNKS_PER_SPLIT
    c_hi = tl.minimum(c_lo + CHUNKS_PER_SPLIT, K // (8 * ROWS))
    for m in range(M):
        acc = tl.zeros([BLOCK_N], tl.float32)
        x_row = x_ptr + m * stride_xm
        for c in range(c_lo, c_hi):
            rp = c * ROWS + rr  # packed rows: inputs 8 * rp + j
            g = (c * ROWS * 8) // GROUP
            w_ptrs = qw_ptr + rp.to(tl.int64)[:, None] * N + rn[None, :]
            if EVEN_N:
                lo = tl.load(w_ptrs)
                z = tl.load(zero_ptr + g * N + rn).to(tl.float32)
                s = tl.load(scale_ptr + g * N + rn).to(tl.float32)
            else:
                lo = tl.load(w_ptrs, mask=n_ok[None, :], other=0)
                z = tl.load(zero_ptr + g * N + rn, mask=n_ok, other=0).to(tl.float32)
                s = tl.load(scale_ptr + g * N + rn, mask=n_ok, other=0.0).to(tl.float32)
            t = tl.zeros([BLOCK_N], tl.float32)
            word = lo
            for j in tl.static_range(8):
                if j == 5:
                    word = lo >> 12  # nibbles 5..7 to bits 8..19 (nibble 4 sits at bits 16..19 of lo)
                p = 4 * j if j < 5 else 4 * j - 12  # the nibble's lowest bit in word
                v = ((word & (15 << p)) | MAGIC).to(tl.float32, bitcast=True)  # 2^23 + q 2^p
                wj = v * (1.0 / (1 << p)) - (z + (1 << (23 - p)))[None, :]  # q - z, exactly
                xj = tl.load(x_row + rp * 8 + j).to(tl.float32)
                t += tl.sum(wj * xj[:, None], 0)
            acc += t * s
        if SPLIT_K:
            part = part_ptr + (pid_k * M + m) * N + rn
            tl.store(part, acc, mask=n_ok)
        else:
            if HAS_BIAS:
                acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
            tl.store(out_ptr + m * stride_om + rn, acc.to(out_ptr.dtype.element_ty), mask=n_ok)
    if SPLIT_K:
        tl.debug_barrier()  # every thread's partials are written before the (single-thread) atomic
        count = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if count == SPLIT - 1:
            for m in range(M):
                total = tl.zeros([BLOCK_N], tl.float32)
                for s_ in range(SPLIT):
                    total += tl.load(part_ptr + (s_ * M + m) * N + rn, mask=n_ok, other=0.0, cache_modifier=".cg")
                if HAS_BIAS:
                    total += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
                tl.store(out_ptr + m * stride_om + rn, total.to(out_ptr.dtype.element_ty), mask=n_ok)
            tl.store(count_ptr + pid_n, 0)


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _split(k: int, block_k: int, tiles: int, split: int | None, programs: int, most: int) -> tuple[int, int]:
    """(SPLIT, K per split) in whole BLOCK_K steps: by default about `programs` programs in
    all, at most `most` splits."""
    steps = triton.cdiv(k, block_k)
    if split is None:
        split = max(1, min(steps, most, triton.cdiv(programs, tiles)))
    per = triton.cdiv(steps, split)
    return triton.cdiv(steps, per), per * block_k


def gemv_config(n: int, fp8: bool) -> dict:
    """Tiles measured fastest at one row (benchmarks/gemv_bench.py --sweep, 8B shapes):
    64-wide N tiles, ~264 programs; the widest layers (gate|up) 128 x 128 tiles, no split."""
    if fp8 and n >= 16384:
        return dict(block_n=128, block_k=128, stages=4, programs=264)
    return dict(block_n=64, block_k=256 if fp8 else 128, stages=4, programs=264)


def gemv(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor | None, bias: torch.Tensor | None, *,
         xq: tuple[torch.Tensor, torch.Tensor] | None = None, block_n: int | None = None,
         block_k: int | None = None, split: int | None = None, warps: int = 4,
         stages: int | None = None) -> torch.Tensor:
    """x [M <= 16, K] (last dim contiguous) @ w [N, K]^T -> [M, N] in x's dtype. w in x's dtype
    (``w_scale`` None), or e4m3 with per-channel float32 ``w_scale`` [N]: then x is quantized
    per token first (``per_token_quant_fp8``, the quantization of the prefill path), unless
    ``xq`` (e4m3 [M, K] contiguous, scales [M, 1]) brings that quantization along.
    Tile arguments left out come from ``gemv_config``."""
    from expresslane.quant.kernels import per_token_quant_fp8

    m, k = x.shape
    n = w.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    if m > 16:
        raise ValueError(f"gemv takes at most 16 rows, got {m}")
    fp8 = w_scale is not None
    cfg = gemv_config(n, fp8)
    block_n, block_k, stages = block_n or cfg["block_n"], block_k or cfg["block_k"], stages or cfg["stages"]
    dot = "fp32" if x.dtype == torch.float32 or fp8 and _interpreted() else ("fp8" if fp8 else "act")
    xin, xs = (xq or per_token_quant_fp8(x)) if fp8 else (x, out)
    tiles = triton.cdiv(n, block_n)
    nsplit, k_split = _split(k, block_k, tiles, split, cfg["programs"], 16)
    part = torch.empty((nsplit, m, n), dtype=torch.float32, device=x.device) if nsplit > 1 else out
    gemv_kernel[(tiles, nsplit)](
        xin, xs, w, w_scale if fp8 else out, bias if bias is not None else out, out, part, arrival_counters(x.device),
        m, n, k, xin.stride(0), out.stride(0), nsplit, k_split, FP8=fp8, DOT=dot, HAS_BIAS=bias is not None,
        SPLIT_K=nsplit > 1, EVEN=n % block_n == 0 and k % block_k == 0, BLOCK_M=16, BLOCK_N=block_n,
        BLOCK_K=block_k, num_warps=warps, num_stages=stages)
    return out


def int4_rows(group: int, rows: int = 8) -> int:
    """Packed rows per chunk: the largest power of two up to `rows` that divides group / 8
    (8 rows of 8 words per thread take 168 registers; 16 rows spill)."""
    while (group // 8) % rows:
        rows //= 2
    return rows


def int4_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
              bias: torch.Tensor | None, group: int, *, block_n: int = 256, split: int | None = None,
              warps: int = 2, rows: int = 8, stages: int = 1) -> torch.Tensor:
    """x [M, K] (last dim contiguous) @ the W4A16 weight (int4.py's layout) -> [M, N]."""
    m, k = x.shape
    n = qweight.shape[1]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    rows = int4_rows(group, rows)
    chunks = k // (8 * rows)
    tiles = triton.cdiv(n, block_n)
    nsplit, per = _split(chunks, 1, tiles, split, 1056, chunks // 2)
    part = torch.empty((nsplit, m, n), dtype=torch.float32, device=x.device) if nsplit > 1 else out
    int4_gemv_kernel[(tiles, nsplit)](
        x, qweight, scales, zeros, bias if bias is not None else out, out, part, arrival_counters(x.device),
        m, n, k, x.stride(0), out.stride(0), nsplit, per, 0x4B000000, GROUP=group, ROWS=rows, HAS_BIAS=bias is not None,
        SPLIT_K=nsplit > 1, EVEN_N=n % block_n == 0, BLOCK_N=block_n, num_warps=warps, num_stages=stages)
    return out
