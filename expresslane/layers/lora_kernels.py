"""Segmented LoRA kernels (Punica / S-LoRA's shrink and expand) over a step's tokens grouped by
adapter slot: `LoRAStep.kernel_inputs` gives the tokens listed slot by slot and the step's
tiles, each up to BLOCK_M tokens of one slot (its slot, first index in the list, count). A grid
has one row of programs per tile the step could have (`lora.max_tiles`: it depends on the token
count and the slot count only, so a CUDA graph captures it); a tile past the step's own is empty
and its programs return at once. Base-model tokens (slot 0) are in no tile.

  shrink: u[t, :] = x[t, :] @ A[slot(t)]^T       (float32, in part[0])
  expand: y[t, off:off+n] += u[t, i*R:(i+1)*R] @ B[slot(t), off:off+n]^T

A decode step's shrink reads A [slices * R, in] for a handful of tokens: one program per tile
would read all of it alone, so the input dim is split over programs. Each writes its partial
sum to part[s] and counts itself in on its tile's counter; the tile's last program sums the
partials (in split order) into part[0], so every expand program reads u once, not once per split
(an expand over a wide projection has hundreds of programs per tile). The expand runs every
slice of a merged projection in one launch when the slice boundaries fall on whole output tiles
(they do for real models), else one launch per slice.

A one-token step (batch-1 decode) instead runs `lora_gemv`: the base projection as quant/gemv.py's
split-K GEMV with the adapter inline. Each program adds its input slice's share of the delta,
(x[K_s] @ A[slot, slice rows, K_s]^T) @ B[slot, tile]^T, to its partial before the split-K sum
(the delta is linear in x, so the slices' shares add up to it): one launch a projection, no
shrink and no expand. The slot comes from the step's tile 0; an empty tile adds nothing.
"""

from __future__ import annotations

import torch

from expresslane.device import arrival_counters
from expresslane.quant.gemv import _arrive, _split, gemv_config
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
def lora_shrink_kernel(x_ptr, a_ptr, part_ptr, count_ptr, sorted_ptr, tiles_ptr, num_tokens, n, k, k_per_split,
                       splits, stride_x, stride_as, stride_an, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, PRECISION: tl.constexpr):
    """part [splits, num_tokens, n] contiguous; the sum over splits lands in part[0]."""
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
    acc = tl.trans(acc)  # [BLOCK_N, BLOCK_M], as _arrive takes it
    if SPLIT_K:
        acc, last = _arrive(part_ptr, count_ptr, acc, tile, pid_s, num_tokens, n, rows, offs_n, valid, mask_n,
                            splits)
    else:
        last = True
    if last:
        tl.store(part_ptr + rows[None, :] * n + offs_n[:, None], acc, mask=mask_n[:, None] & valid[None, :])


@triton.jit
def lora_expand_kernel(part_ptr, b_ptr, y_ptr, sorted_ptr, tiles_ptr, n, rank, bound1, bound2, u_offset,
                       y_offset, stride_pt, stride_bs, stride_bn, stride_y, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, PRECISION: tl.constexpr):
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
        ut = tl.load(part_ptr + rows[:, None] * stride_pt + u_col + offs_r[None, :],
                     mask=valid[:, None] & mask_r[None, :], other=0.0)
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
    """part [splits, T, slices * R] float32 (written into `part` when given: `shrink_output`), with
    x @ A^T in part[0] (rows of base-model tokens left unwritten; parts past 0 are scratch);
    `step`: a `layers.lora.LoRAStep`."""
    _, n, k = lora_a.shape
    sorted_tokens, tiles, num_tiles = step.kernel_inputs(x.shape[0])
    x = x if x.stride(-1) == 1 else x.contiguous()
    splits, k_per_split = _split_k(x.shape[0], k)
    part = shrink_output(x, lora_a, splits) if part is None else part
    assert part.is_contiguous() and part.shape == (splits, x.shape[0], n)
    lora_shrink_kernel[(num_tiles, splits)](
        x, lora_a, part, arrival_counters(x.device, "lora-shrink"), sorted_tokens, tiles, x.shape[0], n, k,
        k_per_split, splits, x.stride(0), lora_a.stride(0), lora_a.stride(1), BLOCK_M=BLOCK_M,
        BLOCK_N=max(16, triton.next_power_of_2(n)), BLOCK_K=BLOCK_K, SPLIT_K=splits > 1, PRECISION=_precision(x.dtype))
    return part


_NO_BOUND = 1 << 30  # a slice boundary no column reaches


def _merged_bounds(slices: list[tuple[int, int]]) -> list[int] | None:
    """The two slice boundaries a merged launch takes (bound1, bound2: relative to the first
    slice's offset, _NO_BOUND where there are fewer slices), or None unless the slices (up to
    three) are consecutive."""
    start = slices[0][0]
    if len(slices) > 3 or any(off + size != slices[i + 1][0] for i, (off, size) in enumerate(slices[:-1])):
        return None
    return [off - start for off, _ in slices[1:]] + [_NO_BOUND] * (3 - len(slices))


def lora_expand(part: torch.Tensor, lora_b: torch.Tensor, y: torch.Tensor, slices: list[tuple[int, int]],
                step) -> None:
    """y[:, slice] += the slice's rank space @ B[slot, slice]^T, in place: the slices of a merged
    projection (consecutive, up to three) in one launch when their boundaries fall on whole output
    tiles (they do for real models), else slice by slice."""
    rank = lora_b.shape[2]
    sorted_tokens, tiles, num_tiles = step.kernel_inputs(y.shape[0])
    start = slices[0][0]
    bounds = _merged_bounds(slices)
    if bounds is not None and all(b % BLOCK_N == 0 for b in bounds if b != _NO_BOUND):
        groups = [(0, start, slices[-1][0] + slices[-1][1] - start, *bounds)]
    else:
        groups = [(i, off, size, _NO_BOUND, _NO_BOUND) for i, (off, size) in enumerate(slices)]
    for first, offset, n, bound1, bound2 in groups:
        lora_expand_kernel[(num_tiles, triton.cdiv(n, BLOCK_N))](
            part, lora_b, y, sorted_tokens, tiles, n, rank, bound1, bound2, first * rank, offset, part.stride(1),
            lora_b.stride(0), lora_b.stride(1), y.stride(0), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_R=BLOCK_R,
            PRECISION=_precision(y.dtype))


@triton.jit
def lora_gemv_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, part_ptr, count_ptr, a_ptr, b_ptr, tiles_ptr, N, K, SPLIT,
                     K_SPLIT, rank, bound1, bound2, stride_as, stride_an, stride_bs, stride_bn, HAS_BIAS: tl.constexpr,
                     SPLIT_K: tl.constexpr, EVEN: tl.constexpr, IEEE: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr):
    """out [1, N] = x [1, K] @ W^T (+ bias) + the delta of tile 0's slot. An output tile's slice
    (which rank rows of A it reads) counts the slice boundaries bound1, bound2 (multiples of
    BLOCK_N) at or before its first column, as in lora_expand_kernel."""
    BLOCK_M: tl.constexpr = 16  # the dot's narrow side; row 0 alone is real
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rr = tl.arange(0, BLOCK_R)
    m_ok = rm < 1
    n_ok = rn < N
    slot = tl.load(tiles_ptr).to(tl.int64)
    has = tl.load(tiles_ptr + 2) > 0
    first = pid_n * BLOCK_N
    a_row = ((first >= bound1).to(tl.int32) + (first >= bound2).to(tl.int32)) * rank
    a_ok = has & (rr < rank)
    a_rows = a_ptr + slot * stride_as + (a_row + rr)[:, None] * stride_an
    k_lo = pid_k * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    u = tl.zeros([BLOCK_R, BLOCK_M], tl.float32)  # this slice of K's share of x @ A^T
    for k0 in range(k_lo, k_hi, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        w_ptrs = w_ptr + rn.to(tl.int64)[:, None] * K + rk[None, :]
        if EVEN:
            w = tl.load(w_ptrs)
        else:
            w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        xt = tl.trans(tl.load(x_ptr + rm[:, None] * 0 + rk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0))
        a = tl.load(a_rows + rk[None, :], mask=a_ok[:, None] & k_ok[None, :], other=0.0)  # no reads without a slot
        if IEEE:
            acc = tl.dot(w, xt, acc, input_precision="ieee")
            u = tl.dot(a, xt, u, input_precision="ieee")
        else:
            acc = tl.dot(w, xt, acc)
            u = tl.dot(a, xt, u)
    if has:
        bt = tl.load(b_ptr + slot * stride_bs + rn[:, None] * stride_bn + rr[None, :],
                     mask=n_ok[:, None] & (rr < rank)[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(bt, u, acc, input_precision="ieee")
        else:
            acc = tl.dot(bt, u.to(bt.dtype), acc)
    if SPLIT_K:
        acc, last = _arrive(part_ptr, count_ptr, acc, pid_n, pid_k, 1, N, rm, rn, m_ok, n_ok, SPLIT)
    else:
        last = True
    if last:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        tl.store(out_ptr + rm[None, :] * 0 + rn[:, None], acc.to(out_ptr.dtype.element_ty),
                 mask=n_ok[:, None] & m_ok[None, :])


def inline_block_n(weight: torch.Tensor, slices: list[tuple[int, int]]) -> int | None:
    """The output tile `lora_gemv` runs this projection with (gemv_config's, halved down to 16
    until the slice boundaries fall on whole tiles), or None where it does not take it: a weight
    not in a float dtype, or slices (up to three) not covering its outputs in order."""
    ends = [off + size for off, size in slices]
    if not (weight.dim() == 2 and weight.dtype in (torch.bfloat16, torch.float16, torch.float32) and slices
            and slices[0][0] == 0 and ends[-1] == weight.shape[0] and _merged_bounds(slices) is not None):
        return None
    block_n = gemv_config(weight.shape[0], False)["block_n"]
    while block_n > 16 and any(end % block_n for end in ends[:-1]):
        block_n //= 2
    return None if any(end % block_n for end in ends[:-1]) else block_n


def lora_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lora_a: torch.Tensor,
              lora_b: torch.Tensor, slices: list[tuple[int, int]], step, block_n: int) -> torch.Tensor:
    """x [1, K] @ weight [N, K]^T (+ bias) + the token's adapter delta -> [1, N] (`block_n`:
    `inline_block_n`'s; `step`: a `layers.lora.LoRAStep` whose tile 0 holds the token, or none)."""
    n, k = weight.shape
    cfg = gemv_config(n, False)
    block_k = cfg["block_k"]
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    _, tiles, _ = step.kernel_inputs(1)
    rank = lora_b.shape[2]
    bounds = _merged_bounds(slices)  # slices from 0 (inline_block_n checked them)
    n_tiles = triton.cdiv(n, block_n)
    nsplit, k_split = _split(k, block_k, n_tiles, None, cfg["programs"], 16)
    part = torch.empty((nsplit, 1, n), dtype=torch.float32, device=x.device) if nsplit > 1 else out
    lora_gemv_kernel[(n_tiles, nsplit)](
        x, weight, bias if bias is not None else out, out, part, arrival_counters(x.device), lora_a, lora_b, tiles,
        n, k, nsplit, k_split, rank, bounds[0], bounds[1], lora_a.stride(0), lora_a.stride(1), lora_b.stride(0),
        lora_b.stride(1), HAS_BIAS=bias is not None, SPLIT_K=nsplit > 1, EVEN=n % block_n == 0 and k % block_k == 0,
        IEEE=x.dtype == torch.float32, BLOCK_N=block_n, BLOCK_K=block_k,
        BLOCK_R=max(16, triton.next_power_of_2(rank)), num_warps=4, num_stages=cfg["stages"])
    return out
