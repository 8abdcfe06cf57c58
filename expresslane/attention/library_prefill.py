"""Prefill attention through a library kernel (cuDNN's, through torch) over our paged cache.

cuDNN has no causal mask aligned to the bottom right, which a chunk after cached keys needs.
So a chunk runs as two calls: its queries over the cached keys without a mask, and over its
own keys under the causal mask (a square there, so top-left and bottom-right agree); one
Triton kernel merges the two outputs by their log-sum-exps straight into the step's output.
A prompt with nothing cached is the second call alone. K/V are gathered from the seq's pages
and passed grouped (torch 2.11's cuDNN op takes fewer K/V heads than query heads; on the H200
that was 882 against 1,031 us a layer for 8k tokens with K/V expanded to every query head,
with equal output). On CPU (tests, Triton's interpreter) torch's CPU flash op stands in for
cuDNN, on K/V expanded to every head (it takes no groups): the gather, the split and the
merge are the same code.

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
# seq of TritonAttentionBackend.LIBRARY_MIN_TOKENS or more; auto, the library for a long prompt with
# nothing cached (FRESH_MIN_TOKENS or more: one eager step of its own, no merge, where the library
# measured faster than our kernel), our kernel for everything else (chunks after cached keys, where
# the gather and the merge ate the library's lead: docs/performance.md, session 8)
LIBRARIES = ("triton", "cudnn", "auto")


def attend_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [1, H, L, D], log-sum-exp [1, H, L, 1] float32) of [1, H, *, D] tensors."""
    if q.is_cuda:
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False,
                                                                      scale=scale)[:2]
    else:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)[:2]
    return out, lse.reshape(*out.shape[:3], 1).float()


def chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, out: torch.Tensor) -> None:
    """Causal attention of a chunk's queries q [L, H, D], the last L of the keys k/v [ctx, Hk, D]
    (Hk = H on CPU), into out [L, H, D]."""
    cached = k.shape[0] - q.shape[0]
    qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    own, lse = attend_lse(qh, kh[:, :, cached:], vh[:, :, cached:], True, scale)
    if not cached:
        out.copy_(own[0].transpose(0, 1))
        return
    old, lse_c = attend_lse(qh, kh[:, :, :cached], vh[:, :, :cached], False, scale)
    merge_by_lse(own[0], lse[0, :, :, 0], old[0], lse_c[0, :, :, 0], out)


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


def seq_attention(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, seq: int, group: int,
                  scale: float, out: torch.Tensor) -> None:
    """Prefill seq `seq` of the step (its rows of q [T, H, D]) over the paged cache [2, blocks,
    page, KV, D] of a 16-bit (or float32) dtype, into its rows of out [T, H, D]."""
    lo, hi = meta.query_start_loc_cpu[seq], meta.query_start_loc_cpu[seq + 1]
    k, v = (x[0].repeat_interleave(group, 1) if group > 1 and not q.is_cuda else x[0]
            for x in gather_kv(kv_cache, meta.block_tables[seq:seq + 1], meta.seq_lens_cpu[seq]))
    chunk_attention(q[lo:hi], k, v, scale, out[lo:hi])
