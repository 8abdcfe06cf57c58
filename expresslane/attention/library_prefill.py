"""Prefill attention through a library kernel (cuDNN's, through torch) over our paged cache.

cuDNN has no causal mask aligned to the bottom right, which a chunk after cached keys needs.
So a chunk runs as two calls: its queries over the cached keys without a mask, and over its
own keys under the causal mask (a square there, so top-left and bottom-right agree); the two
outputs are merged by their log-sum-exps. A prompt with nothing cached is the second call
alone. K/V are gathered from the seq's pages and expanded to every query head first (the
library's GQA support varies by version; torch 2.11's cuDNN op takes grouped K/V, and on the
H200 its output equalled the expanded call's, 882 against 1,031 us a layer for 8k tokens with
the expansion, but that path has not yet run through the engine on the GPU). On CPU (tests,
Triton's interpreter) torch's CPU flash op stands in for cuDNN: the gather, the split and the
merge are the same code.

Eager only: the shapes follow each seq's length, so steps with such a seq run outside the
CUDA graphs (`TritonAttentionBackend.eager_step`).
"""

from __future__ import annotations

import torch

from expresslane.attention.backend import AttentionMetadata
from expresslane.attention.torch_backend import gather_kv

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


def chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of a chunk's queries q [L, H, D], the last L of the keys k/v [ctx, H, D]
    (heads expanded): [L, H, D]."""
    cached = k.shape[0] - q.shape[0]
    qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    out, lse = attend_lse(qh, kh[:, :, cached:], vh[:, :, cached:], True, scale)
    if cached:
        out_c, lse_c = attend_lse(qh, kh[:, :, :cached], vh[:, :, :cached], False, scale)
        top = torch.maximum(lse, lse_c)
        w, w_c = (lse - top).exp(), (lse_c - top).exp()
        out = (out * w + out_c * w_c) / (w + w_c)
    return out.squeeze(0).transpose(0, 1).to(q.dtype)


def seq_attention(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, seq: int, group: int,
                  scale: float) -> torch.Tensor:
    """Prefill seq `seq` of the step (its rows of q [T, H, D]) over the paged cache [2, blocks,
    page, KV, D] of a 16-bit (or float32) dtype: [its tokens, H, D]."""
    lo, hi = meta.query_start_loc_cpu[seq], meta.query_start_loc_cpu[seq + 1]
    k, v = (x[0].repeat_interleave(group, 1) if group > 1 else x[0]
            for x in gather_kv(kv_cache, meta.block_tables[seq:seq + 1], meta.seq_lens_cpu[seq]))
    return chunk_attention(q[lo:hi], k, v, scale)
