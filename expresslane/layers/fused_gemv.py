"""The decode layer's GEMVs with their neighbours folded in (``fused_decode_layer``): the
split-K GEMV of quant/gemv.py (N-tiles x SPLIT K-slices, the tile's last program sums the
partials in split order) for 16-bit (or, in the interpreter, float32) weights, plus

- ``norm`` (RMSNorm before QKV and gate|up): the norm weight g lives in W's columns (folded
  at load), so ``rmsnorm(h) @ W^T = (h @ (W g)^T) * rsqrt(mean(h^2) + eps)`` per row. Each
  program also sums h^2 over its own K-slice, as the diagonal of x x^T, a second small dot on
  the operand it already holds (a row reduction each step made the loop spill registers);
  the last one sums those partials in split order with the dot's and scales the row in the
  epilogue: no pass over h of its own.
- ``silu`` (down's prologue): x is gate|up [M, 2K]; each program computes silu(g) * u of its
  K-slice as it loads it (rounded where the SiLU-and-mul kernel rounds).
- ``residual`` (o_proj and down): out = x @ W^T + residual, the next residual stream.
"""

from __future__ import annotations

import torch

from expresslane.device import arrival_counters
from expresslane.quant.gemv import _arrive, _split
from expresslane.triton_setup import tl, triton

MAX_ROWS = 16  # one BLOCK_M tile of rows: the CUDA-graph decode batches this path serves


def fused_config(n: int, silu: bool) -> dict:
    """Tiles measured fastest per op at one and eight rows (benchmarks/fused_gemv_sweep.py, 8B
    shapes): whole-K programs, except down (SiLU prologue, K = 14336) split about 264 ways."""
    if silu:
        return dict(block_n=64, block_k=128, stages=3, split=None)
    if n >= 16384:
        return dict(block_n=128, block_k=256, stages=3, split=1)
    return dict(block_n=64, block_k=256, stages=4, split=1)


@triton.jit
def fused_gemv_kernel(x_ptr, w_ptr, bias_ptr, res_ptr, out_ptr, part_ptr, sq_ptr, count_ptr,
                      M, N, K, stride_xm, stride_rm, stride_om, SPLIT, K_SPLIT, eps,
                      NORM: tl.constexpr, SILU: tl.constexpr, HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr,
                      SPLIT_K: tl.constexpr, EVEN: tl.constexpr, DOT: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """W [N, K] and x in the activation dtype (SILU: x [M, 2K], gate then up). NORM: sum-of-
    squares partials [tiles, SPLIT, BLOCK_M] in sq_ptr, one row per (tile, split), so the
    last program reads only its own tile's. DOT ``fp32``: float32 activations (interpreter)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    x_rows = x_ptr + rm[:, None] * stride_xm
    k_lo = pid_k * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    gram = tl.zeros([BLOCK_M, BLOCK_M], tl.float32)  # NORM: x x^T, whose diagonal is each row's sum of squares
    for k0 in range(k_lo, k_hi, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        w_ptrs = w_ptr + rn.to(tl.int64)[:, None] * K + rk[None, :]
        if EVEN:
            w = tl.load(w_ptrs)
        else:
            w = tl.load(w_ptrs, mask=n_ok[:, None] & (rk < K)[None, :], other=0.0)
        x_ok = m_ok[:, None] & (rk < K)[None, :]
        if SILU:
            g = tl.load(x_rows + rk[None, :], mask=x_ok, other=0.0).to(tl.float32)
            u = tl.load(x_rows + K + rk[None, :], mask=x_ok, other=0.0)
            s = (g / (1.0 + tl.exp(-g))).to(u.dtype).to(tl.float32)
            x = (s * u.to(tl.float32)).to(u.dtype)
        else:
            x = tl.load(x_rows + rk[None, :], mask=x_ok, other=0.0)
        if DOT == "fp32":
            acc = tl.dot(w, tl.trans(x), acc, input_precision="ieee")
            if NORM:
                gram = tl.dot(x, tl.trans(x), gram, input_precision="ieee")
        else:
            acc = tl.dot(w, tl.trans(x), acc)
            if NORM:  # a tensor-core dot: 16-bit products are exact in its float32 sums
                gram = tl.dot(x, tl.trans(x), gram)
    sq = tl.sum(tl.where(rm[:, None] == rm[None, :], gram, 0.0), 1)
    sq_row = sq_ptr + pid_n * SPLIT * BLOCK_M + rm
    if SPLIT_K:
        if NORM:
            tl.store(sq_row + pid_k * BLOCK_M, sq)  # before _arrive's barrier and counting in
        acc, last = _arrive(part_ptr, count_ptr, acc, pid_n, pid_k, M, N, rm, rn, m_ok, n_ok, SPLIT)
    else:
        last = True
    if last:
        if NORM:
            if SPLIT_K:
                sq = tl.zeros([BLOCK_M], tl.float32)
                for s_ in range(SPLIT):
                    sq += tl.load(sq_row + s_ * BLOCK_M, cache_modifier=".cg")
            acc = acc * tl.math.rsqrt(sq / K + eps)[None, :]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        ok = n_ok[:, None] & m_ok[None, :]
        if HAS_RES:
            acc += tl.load(res_ptr + rm[None, :] * stride_rm + rn[:, None], mask=ok, other=0.0).to(tl.float32)
        o = out_ptr + rm[None, :] * stride_om + rn[:, None]
        tl.store(o, acc.to(out_ptr.dtype.element_ty), mask=ok)


def fused_gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *, norm_eps: float | None = None,
               residual: torch.Tensor | None = None, silu: bool = False, block_n: int | None = None,
               block_k: int | None = None, split: int | None = None, warps: int = 4,
               stages: int | None = None) -> torch.Tensor:
    """x [M <= 16, K] (silu: [M, 2K], gate|up) @ w [N, K]^T -> [M, N] in x's dtype, with
    ``norm_eps``: each row scaled by rsqrt(mean(x^2) + eps) (x's RMS before the dot; w holds
    the norm weight), then + bias, then + ``residual`` [M, N]. Last dims contiguous."""
    m = x.shape[0]
    k = x.shape[1] // 2 if silu else x.shape[1]
    n = w.shape[0]
    if w.shape[1] != k or w.dtype != x.dtype:
        raise ValueError(f"fused_gemv: weight {tuple(w.shape)} {w.dtype} does not fit x {tuple(x.shape)} {x.dtype}"
                         f"{' (gate|up)' if silu else ''}")
    if not 0 < m <= MAX_ROWS:
        raise ValueError(f"fused_gemv takes 1 to {MAX_ROWS} rows, got {m}")
    if residual is not None and residual.shape != (m, n):
        raise ValueError(f"fused_gemv: residual {tuple(residual.shape)} does not fit the output {(m, n)}")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    cfg = fused_config(n, silu)
    block_n, block_k, stages = block_n or cfg["block_n"], block_k or cfg["block_k"], stages or cfg["stages"]
    tiles = triton.cdiv(n, block_n)
    nsplit, k_split = _split(k, block_k, tiles, split or cfg["split"], 264, 16)
    part = torch.empty((nsplit, m, n), dtype=torch.float32, device=x.device) if nsplit > 1 else out
    sq = (torch.empty((tiles, nsplit, MAX_ROWS), dtype=torch.float32, device=x.device)
          if norm_eps is not None and nsplit > 1 else out)
    dot = "fp32" if x.dtype == torch.float32 else "act"
    res = residual if residual is not None else out
    fused_gemv_kernel[(tiles, nsplit)](
        x, w, bias if bias is not None else out, res, out, part, sq, arrival_counters(x.device),
        m, n, k, x.stride(0), res.stride(0), out.stride(0), nsplit, k_split, float(norm_eps or 0.0),
        NORM=norm_eps is not None, SILU=silu, HAS_RES=residual is not None, HAS_BIAS=bias is not None,
        SPLIT_K=nsplit > 1, EVEN=n % block_n == 0 and k % block_k == 0, DOT=dot, BLOCK_M=MAX_ROWS,
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages)
    return out
