"""Segmented LoRA kernels (Punica / S-LoRA's shrink and expand) over a step's tokens grouped by
adapter slot: `LoRAStep.kernel_inputs` gives the tokens listed slot by slot and the step's
tiles, each up to BLOCK_M tokens of one slot (its slot, first index in the list, count). A grid
has one row of programs per tile the step could have (`lora.max_tiles`: it depends on the token
count and the slot count only, so a CUDA graph captures it); a tile past the step's own is empty
and its programs return at once. Base-model tokens (slot 0) are in no tile.

  shrink: part[s, t, :] = x[t, K_s] @ A[slot(t), :, K_s]^T      split s of the input dim (float32)
  expand: y[t, off:off+n] += (sum_s part[s, t, i*R:(i+1)*R]) @ B[slot(t), off:off+n]^T

A decode step's shrink reads A [slices * R, in] for a handful of tokens: one program per tile
would read all of it alone, so the input dim is split over programs (no atomics: the expand sums
the partials, its loop over them unrolled so that their loads go out together instead of one
round trip each). The expand runs every slice of a merged projection in one launch when the slice
boundaries fall on whole output tiles (they do for real models), else one launch per slice.
"""

from __future__ import annotations

import torch

from expresslane.triton_setup import tl, triton

BLOCK_M = 16  # a program's tokens: layers.lora.TILE_TOKENS, the step's tiles (tests/test_lora.py checks)
BLOCK_N = 64  # the expand's output tile
BLOCK_K = 64
BLOCK_R = 16
_SPLIT_PROGRAMS = 64  # shrink programs per tile the split aims at (a decode step: ~ half the SMs' worth)


@triton.jit
def _tile_rows(sorted_ptr, tiles_ptr, tile, count, BLOCK_M: tl.constexpr):
    """Tile `tile`'s slot, its tokens (their row indices) and which of them exist."""
    slot = tl.load(tiles_ptr + tile * 3)
    first = tl.load(tiles_ptr + tile * 3 + 1)
    offs = tl.arange(0, BLOCK_M)
    valid = offs < count
    rows = tl.load(sorted_ptr + first + offs, mask=valid, other=0).to(tl.int64)
    return slot, rows, valid


@triton.jit
def lora_shrink_kernel(x_ptr, a_ptr, part_ptr, sorted_ptr, tiles_ptr, n, k, k_per_split, stride_x, stride_as,
                       stride_an, stride_ps, stride_pt, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    tile, pid_s = tl.program_id(0), tl.program_id(1)
    count = tl.load(tiles_ptr + tile * 3 + 2)
    if count == 0:
        return
    slot, rows, valid = _tile_rows(sorted_ptr, tiles_ptr, tile, count, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    mask_n = offs_n < n
    a_base = a_ptr + slot.to(tl.int64) * stride_as
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_lo = pid_s * k_per_split
    for k0 in range(k_lo, k_lo + k_per_split, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < k
        xt = tl.load(x_ptr + rows[:, None] * stride_x + offs_k[None, :], mask=valid[:, None] & mask_k[None, :],
                     other=0.0)
        at = tl.load(a_base + offs_n[None, :] * stride_an + offs_k[:, None], mask=mask_k[:, None] & mask_n[None, :],
                     other=0.0)
        acc += tl.dot(xt, at.to(xt.dtype), input_precision=PRECISION)
    tl.store(part_ptr + pid_s * stride_ps + rows[:, None] * stride_pt + offs_n[None, :], acc,
             mask=valid[:, None] & mask_n[None, :])


@triton.jit
def lora_expand_kernel(part_ptr, b_ptr, y_ptr, sorted_ptr, tiles_ptr, n, rank, bound1, bound2, u_offset,
                       y_offset, stride_ps, stride_pt, stride_bs, stride_bn, stride_y, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, SPLITS: tl.constexpr, PRECISION: tl.constexpr):
    """Output columns y_offset .. y_offset + n, up to three slices: an output tile's slice is the
    number of slice boundaries (bound1, bound2, relative to y_offset; multiples of BLOCK_N) at or
    before its first column; it reads rank columns u_offset + slice * rank onwards."""
    tile, pid_n = tl.program_id(0), tl.program_id(1)
    count = tl.load(tiles_ptr + tile * 3 + 2)
    if count == 0:
        return
    slot, rows, valid = _tile_rows(sorted_ptr, tiles_ptr, tile, count, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < n
    first = pid_n * BLOCK_N
    u_col = u_offset + ((first >= bound1).to(tl.int32) + (first >= bound2).to(tl.int32)) * rank
    b_base = b_ptr + slot.to(tl.int64) * stride_bs + y_offset * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        mask_r = offs_r < rank
        u_mask = valid[:, None] & mask_r[None, :]
        ut = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        u_tile = part_ptr + rows[:, None] * stride_pt + u_col + offs_r[None, :]
        for s in tl.static_range(SPLITS):  # the shrink's partial sums: unrolled, so the loads go out together
            ut += tl.load(u_tile + s * stride_ps, mask=u_mask, other=0.0)
        bt = tl.load(b_base + offs_n[None, :] * stride_bn + offs_r[:, None], mask=mask_r[:, None] & mask_n[None, :],
                     other=0.0)
        acc += tl.dot(ut.to(bt.dtype), bt, input_precision=PRECISION)
    y_tile = y_ptr + rows[:, None] * stride_y + y_offset + offs_n[None, :]
    mask = valid[:, None] & mask_n[None, :]
    y = tl.load(y_tile, mask=mask, other=0.0)
    tl.store(y_tile, (y.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=mask)


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # (tf32 only applies to float32 operands)


def num_splits(num_tokens: int, k: int) -> int:
    """How many parts the shrink cuts the input dim into: about _SPLIT_PROGRAMS programs per slot,
    each at least two BLOCK_K steps."""
    k_blocks = triton.cdiv(k, BLOCK_K)
    return max(1, min(k_blocks // 2, _SPLIT_PROGRAMS // triton.cdiv(num_tokens, BLOCK_M)))


def _split_k(num_tokens: int, k: int) -> tuple[int, int]:
    """(splits, input columns a split takes) of the shrink."""
    k_per_split = triton.cdiv(triton.cdiv(k, BLOCK_K), num_splits(num_tokens, k)) * BLOCK_K
    return triton.cdiv(k, k_per_split), k_per_split


def shrink_output(x: torch.Tensor, lora_a: torch.Tensor, splits: int | None = None) -> torch.Tensor:
    """An empty part [splits, T, slices * R] float32 for `lora_shrink` (splits: `_split_k`'s)."""
    if splits is None:
        splits, _ = _split_k(x.shape[0], lora_a.shape[2])
    return torch.empty(splits, x.shape[0], lora_a.shape[1], dtype=torch.float32, device=x.device)


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, step, part: torch.Tensor | None = None) -> torch.Tensor:
    """part [splits, T, slices * R] float32 (written into `part` when given: `shrink_output`), its
    sum over splits x @ A^T (rows of base-model tokens left unwritten); `step`: a
    `layers.lora.LoRAStep`."""
    _, n, k = lora_a.shape
    sorted_tokens, tiles, num_tiles = step.kernel_inputs(x.shape[0])
    x = x if x.stride(-1) == 1 else x.contiguous()
    splits, k_per_split = _split_k(x.shape[0], k)
    part = shrink_output(x, lora_a, splits) if part is None else part
    lora_shrink_kernel[(num_tiles, splits)](
        x, lora_a, part, sorted_tokens, tiles, n, k, k_per_split, x.stride(0), lora_a.stride(0), lora_a.stride(1),
        part.stride(0), part.stride(1), BLOCK_M=BLOCK_M, BLOCK_N=max(16, triton.next_power_of_2(n)), BLOCK_K=BLOCK_K,
        PRECISION=_precision(x.dtype))
    return part


def lora_expand(part: torch.Tensor, lora_b: torch.Tensor, y: torch.Tensor, slices: list[tuple[int, int]],
                step) -> None:
    """y[:, slice] += the slice's rank space @ B[slot, slice]^T, in place: the slices of a merged
    projection (consecutive, up to three) in one launch when their boundaries fall on whole output
    tiles (they do for real models), else slice by slice."""
    rank = lora_b.shape[2]
    sorted_tokens, tiles, num_tiles = step.kernel_inputs(y.shape[0])
    start = slices[0][0]
    bounds = [off - start for off, _ in slices[1:]]
    one = len(slices) <= 3 and all(b % BLOCK_N == 0 for b in bounds) and all(
        slices[i][0] + slices[i][1] == slices[i + 1][0] for i in range(len(slices) - 1))
    huge = 1 << 30  # a boundary no column reaches
    if one:
        bounds += [huge] * (2 - len(bounds))
        groups = [(0, start, slices[-1][0] + slices[-1][1] - start, *bounds)]
    else:
        groups = [(i, off, size, huge, huge) for i, (off, size) in enumerate(slices)]
    for first, offset, n, bound1, bound2 in groups:
        lora_expand_kernel[(num_tiles, triton.cdiv(n, BLOCK_N))](
            part, lora_b, y, sorted_tokens, tiles, n, rank, bound1, bound2, first * rank, offset, part.stride(0),
            part.stride(1), lora_b.stride(0), lora_b.stride(1), y.stride(0), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
            BLOCK_R=BLOCK_R, SPLITS=part.shape[0], PRECISION=_precision(y.dtype))
