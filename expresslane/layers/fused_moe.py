"""The fused MoE path (GPU, `triton` backend): the experts of a step in two grouped GEMMs.

    align   the (token, slot) rows sorted by expert, each expert's run padded to BLOCK_M
            (torch ops of fixed sizes, no host sync: CUDA graphs capture it)
    GEMM 1  one launch over all experts: each BLOCK_M tile of rows belongs to one expert and
            multiplies its gate and up weights; SiLU(gate) * up is applied before the store
    GEMM 2  one launch: down projection, scaled by the routing weight, one row per (token, slot)
    sum     the k rows of each token

Rows routed to expert -1 (expert parallelism: another rank's) are left out by the alignment
and their output rows stay zero. The kernels round where transformers does (the gate and up
projections, the SiLU, the product to the activation dtype).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def moe_gemm_kernel(a_ptr, w_ptr, c_ptr, topk_w_ptr, sorted_rows_ptr, block_expert_ptr, num_padded_ptr,
                    N, K, num_rows, stride_am, stride_we, stride_wn, stride_cm,
                    TOP_K: tl.constexpr, GATED: tl.constexpr, WEIGHTED: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """C[row, n] = A[row // TOP_K] . W[expert, n] for the rows of one expert's tile; GATED: W
    holds gate rows [0, N) then up rows [N, 2N) and C = silu(gate) * up; WEIGHTED: C *= w[row]."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M < tl.load(num_padded_ptr):
        expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
        rows = tl.load(sorted_rows_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        valid = rows < num_rows  # padding of the expert's run
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + (rows // TOP_K)[:, None] * stride_am + offs_k[None, :]
        w_ptrs = w_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_mask = offs_k + k0 < K
            a = tl.load(a_ptrs, mask=valid[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            acc = tl.dot(a, w, acc, input_precision=PRECISION)
            if GATED:
                w_up = tl.load(w_ptrs + N * stride_wn, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
                acc_up = tl.dot(a, w_up, acc_up, input_precision=PRECISION)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        dtype = c_ptr.dtype.element_ty
        if GATED:
            gate = acc.to(dtype).to(tl.float32)
            silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
            acc = silu * acc_up.to(dtype).to(tl.float32)
        if WEIGHTED:
            acc = acc.to(dtype).to(tl.float32) * tl.load(topk_w_ptr + rows, mask=valid, other=0.0)[:, None]
        tl.store(c_ptr + rows[:, None] * stride_cm + offs_n[None, :], acc.to(dtype),
                 mask=valid[:, None] & n_mask[None, :])


def align_by_expert(ids: torch.Tensor, num_experts: int, block_m: int):
    """(sorted rows [P] int32, expert of each BLOCK_M tile [P / block_m] int32, rows in use [1]):
    the flat (token * k + slot) rows grouped by expert, each group padded to a multiple of
    block_m with the row number ``ids.numel()`` (out of range: not loaded, not stored). P is
    the worst case, fixed by the shape: nothing is read back to the host."""
    flat = ids.flatten()
    n = flat.numel()
    bucket = torch.where(flat < 0, num_experts, flat)  # rows that go nowhere: a last bucket, never computed
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, bucket, torch.ones_like(bucket))
    padded = (counts[:num_experts] + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    order = torch.argsort(bucket, stable=True)
    in_order = bucket[order]
    rank = torch.arange(n, device=ids.device) - (counts.cumsum(0) - counts)[in_order]  # place within its group
    size = -(-(n + num_experts * (block_m - 1)) // block_m) * block_m
    starts = torch.cat([ends.new_zeros(1), ends])  # bucket E (nowhere) starts past the last tile
    dest = torch.where(in_order < num_experts, starts[in_order] + rank, size)
    rows = torch.full((size + 1,), n, dtype=torch.int32, device=ids.device)
    rows.scatter_(0, dest, order.to(torch.int32))
    tile_starts = torch.arange(0, size, block_m, device=ids.device)
    block_expert = torch.searchsorted(ends, tile_starts, right=True).clamp_(max=num_experts - 1).to(torch.int32)
    return rows[:size], block_expert, ends[-1:]


def _tiles(rows: int, num_experts: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): small tiles while few rows reach each expert (decode)."""
    per_expert = rows / num_experts
    if per_expert <= 16:
        return 16, 64, 128
    if per_expert <= 64:
        return 32, 64, 64
    return 64, 64, 64


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                  ids: torch.Tensor) -> torch.Tensor:
    """As layers.moe.torch_experts: x [T, H], w13 [E, 2I, H], w2 [E, H, I], weights/ids [T, k]."""
    tokens, k = ids.shape
    num_experts, two_i, hidden = w13.shape
    inter = two_i // 2
    n = tokens * k
    block_m, block_n, block_k = _tiles(n, num_experts)
    rows, block_expert, num_padded = align_by_expert(ids, num_experts, block_m)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    common = dict(TOP_K=1, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=precision,
                  num_warps=4, num_stages=3 if x.is_cuda else 1)
    act = torch.empty(n, inter, dtype=x.dtype, device=x.device)
    x = x.contiguous()
    grid = (block_expert.shape[0], triton.cdiv(inter, block_n))
    moe_gemm_kernel[grid](x, w13, act, weights, rows, block_expert, num_padded, inter, hidden, n,
                          x.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
                          **{**common, "TOP_K": k}, GATED=True, WEIGHTED=False)
    out = torch.zeros(n, hidden, dtype=x.dtype, device=x.device)  # rows of other ranks' experts stay 0
    grid = (block_expert.shape[0], triton.cdiv(hidden, block_n))
    moe_gemm_kernel[grid](act, w2, out, weights.contiguous(), rows, block_expert, num_padded, hidden, inter, n,
                          act.stride(0), w2.stride(0), w2.stride(1), out.stride(0),
                          **common, GATED=False, WEIGHTED=True)
    return out.view(tokens, k, hidden).sum(1)
