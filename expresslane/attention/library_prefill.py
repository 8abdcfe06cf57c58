"""Prefill attention through a library kernel (cuDNN's, through torch) over our paged cache.

cuDNN has no causal mask aligned to the bottom right, which a chunk after cached keys needs.
So a chunk runs as two calls: its queries over the cached keys without a mask, and over its
own keys under the causal mask (a square there, so top-left and bottom-right agree); one
Triton kernel merges the two outputs by their log-sum-exps straight into the step's output.
Shapes are bucketed so that cuDNN builds few execution plans (`chunk_attention`).
A prompt with nothing cached is the second call alone. K/V are gathered from the seq's pages
and passed grouped (torch 2.11's cuDNN op takes fewer K/V heads than query heads: faster than
K/V expanded to every query head, with equal output). On CPU (tests, Triton's interpreter) torch's CPU flash op stands in for
cuDNN, on K/V expanded to every head inside `attend_lse` (it takes no groups): the gather,
the split and the merge are the same code.

Eager only: the shapes follow each seq's length, so steps with such a seq run outside the
CUDA graphs (`TritonAttentionBackend.eager_step`).
"""

from __future__ import annotations

import torch

from expresslane.attention.backend import AttentionMetadata
from expresslane.attention.torch_backend import gather_kv
from expresslane.attention.triton_kernels import merge_lse_kernel
from expresslane.triton_setup import triton

# the prefill attention choices: triton, our kernel for every seq; cudnn, the library for every prefill
# seq of TritonAttentionBackend.LIBRARY_MIN_TOKENS or more; auto, the library where it measured faster
# (long chunks over long contexts: TritonAttentionBackend.AUTO_MIN_*), our kernel for the rest
LIBRARIES = ("triton", "cudnn", "auto")
Q_BUCKET = 512  # query rows of every library call: a multiple of this
KEY_BUCKET = 2048  # keys of an unmasked call: a multiple of this (a budget's chunks start at multiples of it)


def attend_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [1, H, L, D], log-sum-exp [1, H, L, 1] float32) of q [1, H, L, D] over k/v [1, Hk, S, D]."""
    if q.is_cuda:  # grouped K/V as they are
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False,
                                                                      scale=scale)[:2]
    else:  # the CPU stand-in takes no groups: K/V expanded to every query head
        k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], 1) for x in (k, v))
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)[:2]
    return out, lse.reshape(*out.shape[:3], 1).float()


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def _padded(x: torch.Tensor, rows: int, first: int = 0) -> torch.Tensor:
    """x [n, heads, D] at rows first.. of a zeroed [rows, heads, D], as a [1, heads, rows, D] view."""
    buf = x.new_zeros(rows, *x.shape[1:])
    buf[first:first + x.shape[0]] = x
    return buf.transpose(0, 1).unsqueeze(0)


def chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, out: torch.Tensor) -> None:
    """Causal attention of a chunk's queries q [L, H, D], the last L of the keys k/v [ctx, Hk, D]
    (contiguous rows), into out [L, H, D].

    cuDNN builds an execution plan the first time it sees a shape or stride (tens to hundreds of
    ms; docs/architecture.md), so every call here has bucketed shapes and fixed strides: the unmasked call
    takes the cached keys up to a multiple of KEY_BUCKET; the rest of them join the causal call,
    which gets as many zero query rows in front, so that its square mask still ends each real row
    at its own key; both calls' query rows are padded with zeros to a multiple of Q_BUCKET (and the
    causal call's keys with zero keys, which only the padding rows after the real ones see)."""
    n, cached = q.shape[0], k.shape[0] - q.shape[0]
    old = cached // KEY_BUCKET * KEY_BUCKET  # keys every query sees, in the unmasked call
    late = cached - old  # cached keys in the causal call, behind `late` zero query rows
    rows = _round_up(late + n, Q_BUCKET)
    own, lse = attend_lse(_padded(q, rows, late), _padded(k[old:], rows), _padded(v[old:], rows), True, scale)
    own, lse = own[0, :, late:late + n], lse[0, :, late:late + n, 0]
    if not old:
        out.copy_(own.transpose(0, 1))
        return
    kh, vh = (x[:old].transpose(0, 1).unsqueeze(0) for x in (k, v))  # strides independent of ctx
    prev, lse_c = attend_lse(_padded(q, _round_up(n, Q_BUCKET)), kh, vh, False, scale)
    merge_by_lse(own, lse, prev[0, :, :n], lse_c[0, :, :n, 0], out)


def merge_by_lse(a: torch.Tensor, lse_a: torch.Tensor, b: torch.Tensor, lse_b: torch.Tensor, out: torch.Tensor
                 ) -> None:
    """out [L, H, D] = the softmax-weighted mix of two attentions a, b [H, L, D] over disjoint keys,
    by their log-sum-exps [H, L]."""
    heads, n, d = a.shape
    block = 16
    merge_lse_kernel[(triton.cdiv(n, block), heads)](
        a, b, lse_a, lse_b, out, n, a.stride(0), a.stride(1), b.stride(0), b.stride(1), lse_a.stride(0),
        lse_a.stride(1), lse_b.stride(0), lse_b.stride(1), out.stride(0), out.stride(1),
        HEAD_DIM=d, D_PAD=max(16, 1 << (d - 1).bit_length()), BLOCK_T=block)


def seq_attention(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, seq: int, scale: float,
                  out: torch.Tensor) -> None:
    """Prefill seq `seq` of the step (its rows of q [T, H, D]) over the paged cache [2, blocks,
    page, KV, D] of a 16-bit (or float32) dtype, into its rows of out [T, H, D]."""
    lo, hi = meta.query_start_loc_cpu[seq], meta.query_start_loc_cpu[seq + 1]
    k, v = (x[0] for x in gather_kv(kv_cache, meta.block_tables[seq:seq + 1], meta.seq_lens_cpu[seq]))
    chunk_attention(q[lo:hi], k, v, scale, out[lo:hi])


def warm_plans(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
               max_model_len: int, budget: int, scale: float) -> int:
    """Has cuDNN build, before any request, the plans of a long prompt's full-budget chunks: the
    causal call of a chunk with no late keys and the unmasked call over every multiple of
    KEY_BUCKET cached keys (a lone prompt's chunks start at multiples of the budget), with the
    strides `chunk_attention` gives them. Other shapes (a prompt's last, shorter chunk; a chunk
    after a prefix-cache hit) build on first use, once per process. Returns the number of shapes."""
    rows = _round_up(min(budget, max_model_len), Q_BUCKET)
    q = _padded(torch.zeros(rows, heads, head_dim, dtype=dtype, device=device), rows)
    kv = torch.zeros(max(rows, max_model_len), kv_heads, head_dim, dtype=dtype, device=device)
    attend_lse(q, _padded(kv[:rows], rows), _padded(kv[:rows], rows), True, scale)
    olds = range(KEY_BUCKET, max_model_len, KEY_BUCKET)
    for old in olds:
        k = kv[:old].transpose(0, 1).unsqueeze(0)
        attend_lse(q, k, k, False, scale)
    return 1 + len(olds)
