"""Triton kernels of multi-head latent attention (attention/mla.py has the layout and the
torch reference they are tested against).

``latent_attention_kernel``: one program per (token, tile of BLOCK_H heads, split of the
token's keys; `num_splits`: several only when there are few tokens, the splits combined by
``reduce_latent_splits_kernel``, which reads only the splits that had keys). All heads read
the same latent row of a key, so a tile of heads shares each loaded [BLOCK_N, L + R] tile of
the cache::

    scores [BLOCK_H, BLOCK_N] = q_lat [BLOCK_H, L] @ c_kv^T + q_pe [BLOCK_H, R] @ k_pe^T
    acc    [BLOCK_H, L]      += softmax-weights @ c_kv             (online softmax: m, l)

A token's seq is the first whose end (query_start_loc) lies past it, and it reads keys
0 .. min(position + 1, seq_len) - 1 through that seq's block table. A mixed CUDA graph holds
more seq slots than the step fills, the unfilled ones keeping old values: a real token never
reaches them (its own seq ends first); a padding token (position 0, output dropped) may, and
then reads at most one key of an old block id. A token past every seq reads none, writes zeros.
L and R are padded to powers of two (at least 16, for tl.dot), the pads masked.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from expresslane.attention.backend import AttentionMetadata
from expresslane.attention.triton_kernels import _rope_rows, _rotate_half
from expresslane.triton_setup import rows_per_program, tl, triton

BLOCK_H = 16  # heads a program: tl.dot needs at least 16 rows (fewer heads are masked)
REDUCE_BLOCK_L = 128  # latent dims a reduction program combines (128 splits x 128: 128 floats a thread)


@dataclass(frozen=True)
class LatentTile:
    """The latent kernel's launch shape: keys a loop iteration, warps, software-pipelining depth,
    and how many key splits a token takes (enough programs for `waves` waves of the GPU, at most
    `max_splits`)."""
    block_n: int = 32
    num_warps: int = 4
    num_stages: int = 3
    max_splits: int = 128
    waves: int = 2

    def __str__(self) -> str:
        return f"n{self.block_n}-w{self.num_warps}-s{self.num_stages}-sp{self.max_splits}x{self.waves}"


# ((fewest tokens, tile), ...): the last entry whose count is <= the step's tokens wins (a CUDA
# graph of a size always takes the same). Measured (`mla_bench.py --sweep`, docs/performance.md):
# a lone decode over 8k keys runs fastest over 128 splits, 64 decodes over four waves of programs.
LATENT_TILES = ((1, LatentTile()), (32, LatentTile(waves=4)))
# Triton's interpreter (CPU): 64 keys an iteration, half the Python-level steps of 32 per program
INTERPRETER_TILE = LatentTile(block_n=64)


def latent_tile(num_tokens: int, device: torch.device | None = None) -> LatentTile:
    if device is not None and device.type != "cuda":
        return INTERPRETER_TILE
    return next(tile for low, tile in reversed(LATENT_TILES) if num_tokens >= low)


def _pad(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter on CPU: still exercise several splits


def num_splits(num_tokens: int, heads: int, device: torch.device, tile: LatentTile) -> int:
    """Key splits a token's programs take: enough programs for the tile's waves of the GPU (a few
    decodes over long contexts), by the token and head counts alone, so a CUDA graph of a size
    always takes the same."""
    programs = num_tokens * triton.cdiv(heads, BLOCK_H)
    return max(1, min(tile.max_splits, triton.cdiv(tile.waves * _num_sms(device), programs)))


@triton.jit
def latent_rope_store_kernel(c_ptr, pe_ptr, q_ptr, w_ptr, pos_ptr, slot_ptr, cos_sin_ptr, cache_ptr, q_out_ptr,
                             stride_c, stride_pe, stride_qt, stride_qh, stride_cs, stride_slot, eps, num_tokens,
                             H: tl.constexpr, H_PAD: tl.constexpr, L: tl.constexpr, L_PAD: tl.constexpr,
                             HALF: tl.constexpr, HALF_PAD: tl.constexpr, TOKENS: tl.constexpr):
    """TOKENS new tokens a program (blocks [token, head, dim]): RoPE on their q_pe heads into q_out
    [T, H, 2 HALF], and into each token's cache slot c_kv RMS-normalised (weight w_ptr, rounded as
    layers.norm.RMSNorm rounds) then k_pe rotated; slot -1 (CUDA-graph padding) writes no slot.
    The rotation: rotate-half by the cos|sin row pos_ptr[t] of the table."""
    t, tm, d, dm, cos, sin = _rope_rows(pos_ptr, cos_sin_ptr, stride_cs, num_tokens, TOKENS, HALF, HALF_PAD)
    h = tl.arange(0, H_PAD)[None, :, None]
    m = tm & (h < H) & dm
    src = q_ptr + t * stride_qt + h * stride_qh + d
    r1, r2 = _rotate_half(tl.load(src, mask=m, other=0.0), tl.load(src + HALF, mask=m, other=0.0), cos, sin)
    dst = q_out_ptr + t * (H * 2 * HALF) + h * (2 * HALF) + d
    tl.store(dst, r1, mask=m)
    tl.store(dst + HALF, r2, mask=m)
    slot = tl.load(slot_ptr + t, mask=tm, other=-1)
    row = cache_ptr + slot * stride_slot
    mk = (slot >= 0) & dm
    k1 = tl.load(pe_ptr + t * stride_pe + d, mask=mk, other=0.0)
    k2 = tl.load(pe_ptr + t * stride_pe + HALF + d, mask=mk, other=0.0)
    k1, k2 = _rotate_half(k1, k2, cos, sin)
    tl.store(row + L + d, k1, mask=mk)
    tl.store(row + L + HALF + d, k2, mask=mk)
    e = tl.arange(0, L_PAD)[None, None, :]
    me = (slot >= 0) & (e < L)
    c = tl.load(c_ptr + t * stride_c + e, mask=me, other=0.0)
    f = c.to(tl.float32)
    normed = (f * tl.math.rsqrt(tl.sum(f * f, 2) / L + eps)[:, :, None]).to(c.dtype)
    w = tl.load(w_ptr + e, mask=e < L, other=0.0).to(tl.float32)
    tl.store(row + e, (w * normed.to(tl.float32)).to(cache_ptr.dtype.element_ty), mask=me)


@triton.jit
def latent_attention_kernel(q_lat_ptr, q_pe_ptr, cache_ptr, out_ptr, part_o_ptr, part_lse_ptr, pos_ptr, tables_ptr,
                            seq_lens_ptr, qsl_ptr, num_seqs, num_heads, num_splits, scale, stride_qlt, stride_qlh,
                            stride_qpt, stride_qph, stride_slot, stride_table, stride_ot, stride_oh,
                            L: tl.constexpr, R: tl.constexpr, L_PAD: tl.constexpr, R_PAD: tl.constexpr,
                            BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
                            SEQS_PAD: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr):
    """Program (t, head tile, split): the split's share of the token's keys. SPLIT: its partial
    (normalised output, log-sum-exp) goes to part_o [T, H, splits, L_PAD] / part_lse [T, H,
    splits] for reduce_latent_splits_kernel; otherwise (one split) the output itself."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    s = tl.arange(0, SEQS_PAD)
    ends = tl.load(qsl_ptr + 1 + s, mask=s < num_seqs, other=0)
    seq = tl.min(tl.where((s < num_seqs) & (ends > t), s, num_seqs), axis=0)
    has_seq = seq < num_seqs
    seq_len = tl.load(seq_lens_ptr + seq, mask=has_seq, other=0)
    n_keys = tl.minimum(tl.load(pos_ptr + t) + 1, seq_len)
    chunk = tl.cdiv(tl.cdiv(n_keys, num_splits), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, n_keys)
    dl = tl.arange(0, L_PAD)
    dr = tl.arange(0, R_PAD)
    hm = (h < num_heads)[:, None]
    q_lat = tl.load(q_lat_ptr + t * stride_qlt + h[:, None] * stride_qlh + dl[None, :], mask=hm & (dl < L)[None, :],
                    other=0.0)
    q_pe = tl.load(q_pe_ptr + t * stride_qpt + h[:, None] * stride_qph + dr[None, :], mask=hm & (dr < R)[None, :],
                   other=0.0)
    m = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    den = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, L_PAD), tl.float32)
    table = tables_ptr + seq.to(tl.int64) * stride_table
    for start in range(lo, hi, BLOCK_N):
        k = start + tl.arange(0, BLOCK_N)
        km = k < hi
        block = tl.load(table + k // PAGE, mask=km, other=0).to(tl.int64)
        row = cache_ptr + (block * PAGE + k % PAGE)[:, None] * stride_slot
        c = tl.load(row + dl[None, :], mask=km[:, None] & (dl < L)[None, :], other=0.0)
        pe = tl.load(row + L + dr[None, :], mask=km[:, None] & (dr < R)[None, :], other=0.0)
        scores = tl.dot(q_lat, tl.trans(c), input_precision=PRECISION)
        scores = tl.dot(q_pe, tl.trans(pe), scores, input_precision=PRECISION) * scale
        scores = tl.where(km[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m - m_new)
        den = den * alpha + tl.sum(p, axis=1)
        acc = tl.dot(p.to(c.dtype), c, acc * alpha[:, None], input_precision=PRECISION)
        m = m_new
    out = acc / tl.where(den > 0, den, 1.0)[:, None]
    if SPLIT:
        row = (t * num_heads + h) * num_splits + split
        tl.store(part_o_ptr + row[:, None] * L_PAD + dl[None, :], out, mask=hm & (hi > lo))  # no keys: lse alone
        lse = tl.where(den > 0, m + tl.log(tl.where(den > 0, den, 1.0)), float("-inf"))  # -inf: no keys here
        tl.store(part_lse_ptr + row, lse, mask=h < num_heads)
    else:
        tl.store(out_ptr + t * stride_ot + h[:, None] * stride_oh + dl[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=hm & (dl < L)[None, :])


@triton.jit
def reduce_latent_splits_kernel(part_o_ptr, part_lse_ptr, out_ptr, num_heads, num_splits, stride_ot, stride_oh,
                                L: tl.constexpr, L_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr,
                                BLOCK_L: tl.constexpr):
    """Program (t, head, BLOCK_L latent dims): the splits' partials weighted by exp(lse - max lse),
    read only for splits with keys (lse > -inf; the others wrote none); no keys at all: zeros."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    sp = tl.arange(0, SPLITS_PAD)
    row = (t * num_heads + h) * num_splits + sp
    lse = tl.load(part_lse_ptr + row, mask=sp < num_splits, other=float("-inf"))
    top = tl.max(lse, axis=0)
    w = tl.where(lse > float("-inf"), tl.exp(lse - tl.where(top > float("-inf"), top, 0.0)), 0.0)
    dl = tl.program_id(2) * BLOCK_L + tl.arange(0, BLOCK_L)
    o = tl.load(part_o_ptr + row[:, None] * L_PAD + dl[None, :], mask=(lse > float("-inf"))[:, None], other=0.0)
    total = tl.sum(w, axis=0)
    out = tl.sum(w[:, None] * o, axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + dl, out.to(out_ptr.dtype.element_ty), mask=dl < L)


def rope_store_latent(cache: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor, norm,
                      rotary, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """One launch for a step's latent cache write and its RoPE: cache [blocks, block_size, L + R];
    c_kv [T, L] (normalised by `norm`, an RMSNorm, on the way in), k_pe [T, R], q_pe [T, H, R] (rows
    may be strided); `rotary` a RotaryEmbedding over all R dims. Returns q_pe rotated, [T, H, R]."""
    t, heads, rope = q_pe.shape
    out = torch.empty(t, heads, rope, dtype=q_pe.dtype, device=q_pe.device)
    if t:
        cs, rows = rotary.lookup(positions, meta.rope_lengths)
        half = cs.shape[1] // 2
        if 2 * half != rope:
            raise ValueError(f"the latent cache's RoPE covers all {rope} rope dims; the table has {2 * half}")
        lat = c_kv.shape[1]
        per = rows_per_program(t)
        latent_rope_store_kernel[(triton.cdiv(t, per),)](
            c_kv, k_pe, q_pe, norm.weight, rows, meta.slot_mapping, cs, cache, out, c_kv.stride(0), k_pe.stride(0),
            q_pe.stride(0), q_pe.stride(1), cs.stride(0), cache.stride(1), norm.eps, t, H=heads,
            H_PAD=_pad(heads), L=lat, L_PAD=_pad(lat), HALF=half, HALF_PAD=_pad(half), TOKENS=per)
    return out


def paged_latent_attention(q_lat: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, positions: torch.Tensor,
                           meta: AttentionMetadata, scale: float, tile: LatentTile | None = None) -> torch.Tensor:
    """q_lat [T, H, L], q_pe [T, H, R] of tokens at `positions` [T] over the latent cache -> [T, H, L]
    (`tile`: the launch shape; by default the table's for T tokens)."""
    t, heads, lat = q_lat.shape
    rope = q_pe.shape[-1]
    out = torch.empty_like(q_lat)
    if not t:
        return out
    num_seqs = meta.query_start_loc.shape[0] - 1
    tile = tile or latent_tile(t, q_lat.device)
    splits = num_splits(t, heads, q_lat.device, tile)
    part_o = torch.empty(t, heads, splits, _pad(lat), dtype=torch.float32, device=q_lat.device)
    part_lse = torch.empty(t, heads, splits, dtype=torch.float32, device=q_lat.device)
    latent_attention_kernel[(t, triton.cdiv(heads, BLOCK_H), splits)](
        q_lat, q_pe, cache, out, part_o, part_lse, positions, meta.block_tables, meta.seq_lens, meta.query_start_loc,
        num_seqs, heads, splits, scale, q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1),
        cache.stride(1), meta.block_tables.stride(0), out.stride(0), out.stride(1),
        L=lat, R=rope, L_PAD=_pad(lat), R_PAD=_pad(rope), BLOCK_H=BLOCK_H, BLOCK_N=tile.block_n, PAGE=cache.shape[1],
        SEQS_PAD=_pad(num_seqs + 1), SPLIT=splits > 1, PRECISION="ieee" if q_lat.dtype == torch.float32 else "tf32",
        num_warps=tile.num_warps, num_stages=tile.num_stages)
    if splits > 1:
        block_l = min(_pad(lat), REDUCE_BLOCK_L)
        reduce_latent_splits_kernel[(t, heads, _pad(lat) // block_l)](
            part_o, part_lse, out, heads, splits, out.stride(0), out.stride(1), L=lat, L_PAD=_pad(lat),
            SPLITS_PAD=_pad(splits), BLOCK_L=block_l)
    return out
