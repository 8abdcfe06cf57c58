"""Segmented LoRA kernels (Punica / S-LoRA's shrink and expand) over a step's tokens grouped by
adapter slot: `LoRAStep.sorted_tokens` lists the tokens slot by slot, `slot_starts` and
`slot_counts` say where each slot's run is. The grid is (token tiles, output tiles, slots - 1)
for the worst case (every token in one slot): its size depends on the token count and the
slot count only, so a CUDA graph captures it; a program past its slot's run returns at once.
Slot 0 (the base model) gets no program.

  shrink: u[t, :]        = x[t, :] @ A[slot(t)]^T                    (float32, [T, slices * R])
  expand: y[t, off:off+n] += u[t, i*R:(i+1)*R] @ B[slot(t), off:off+n]^T   (one launch per slice)
"""

from __future__ import annotations

import torch

from expresslane.triton_setup import tl, triton

BLOCK_M = 16
BLOCK_N = 64
BLOCK_K = 64
BLOCK_R = 16


@triton.jit
def _token_rows(sorted_ptr, starts_ptr, counts_ptr, slot, pid_m, BLOCK_M: tl.constexpr):
    """This program's tokens of `slot` (their row indices) and which of them exist."""
    count = tl.load(counts_ptr + slot)
    start = tl.load(starts_ptr + slot)
    offs = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    valid = offs < count
    rows = tl.load(sorted_ptr + start + offs, mask=valid, other=0).to(tl.int64)
    return rows, valid


@triton.jit
def lora_shrink_kernel(x_ptr, a_ptr, u_ptr, sorted_ptr, starts_ptr, counts_ptr, n, k, stride_x, stride_as,
                       stride_an, stride_u, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m, pid_n, slot = tl.program_id(0), tl.program_id(1), tl.program_id(2) + 1
    if pid_m * BLOCK_M >= tl.load(counts_ptr + slot):
        return
    rows, valid = _token_rows(sorted_ptr, starts_ptr, counts_ptr, slot, pid_m, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < n
    a_base = a_ptr + slot.to(tl.int64) * stride_as
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < k
        xt = tl.load(x_ptr + rows[:, None] * stride_x + offs_k[None, :], mask=valid[:, None] & mask_k[None, :],
                     other=0.0)
        at = tl.load(a_base + offs_n[None, :] * stride_an + offs_k[:, None], mask=mask_k[:, None] & mask_n[None, :],
                     other=0.0)
        acc += tl.dot(xt.to(tl.float32), at.to(tl.float32), input_precision="ieee")
    tl.store(u_ptr + rows[:, None] * stride_u + offs_n[None, :], acc, mask=valid[:, None] & mask_n[None, :])


@triton.jit
def lora_expand_kernel(u_ptr, b_ptr, y_ptr, sorted_ptr, starts_ptr, counts_ptr, n, rank, u_offset, y_offset,
                       stride_u, stride_bs, stride_bn, stride_y, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_R: tl.constexpr):
    pid_m, pid_n, slot = tl.program_id(0), tl.program_id(1), tl.program_id(2) + 1
    if pid_m * BLOCK_M >= tl.load(counts_ptr + slot):
        return
    rows, valid = _token_rows(sorted_ptr, starts_ptr, counts_ptr, slot, pid_m, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < n
    b_base = b_ptr + slot.to(tl.int64) * stride_bs + y_offset * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        mask_r = offs_r < rank
        ut = tl.load(u_ptr + rows[:, None] * stride_u + u_offset + offs_r[None, :],
                     mask=valid[:, None] & mask_r[None, :], other=0.0)
        bt = tl.load(b_base + offs_n[None, :] * stride_bn + offs_r[:, None], mask=mask_r[:, None] & mask_n[None, :],
                     other=0.0)
        acc += tl.dot(ut, bt.to(tl.float32), input_precision="ieee")
    y_tile = y_ptr + rows[:, None] * stride_y + y_offset + offs_n[None, :]
    mask = valid[:, None] & mask_n[None, :]
    y = tl.load(y_tile, mask=mask, other=0.0)
    tl.store(y_tile, (y.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=mask)


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, step) -> torch.Tensor:
    """u [T, slices * R] float32 (rows of base-model tokens are left unwritten); `step`: a
    `layers.lora.LoRAStep`."""
    num_slots, n, k = lora_a.shape
    x = x if x.stride(-1) == 1 else x.contiguous()
    u = torch.empty(x.shape[0], n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(x.shape[0], BLOCK_M), triton.cdiv(n, BLOCK_N), num_slots - 1)
    lora_shrink_kernel[grid](x, lora_a, u, step.sorted_tokens, step.slot_starts, step.slot_counts, n, k, x.stride(0),
                             lora_a.stride(0), lora_a.stride(1), u.stride(0), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                             BLOCK_K=BLOCK_K)
    return u


def lora_expand(u: torch.Tensor, lora_b: torch.Tensor, y: torch.Tensor, slices: list[tuple[int, int]],
                step) -> None:
    """y[:, slice] += u's slice of rank space @ B[slot, slice]^T, in place, slice by slice."""
    num_slots, _, rank = lora_b.shape
    for i, (offset, size) in enumerate(slices):
        grid = (triton.cdiv(y.shape[0], BLOCK_M), triton.cdiv(size, BLOCK_N), num_slots - 1)
        lora_expand_kernel[grid](u, lora_b, y, step.sorted_tokens, step.slot_starts, step.slot_counts, size, rank,
                                 i * rank, offset, u.stride(0), lora_b.stride(0), lora_b.stride(1), y.stride(0),
                                 BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_R=BLOCK_R)
