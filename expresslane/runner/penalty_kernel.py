"""The penalties in one pass over the penalized rows' logits (CUDA)."""

from __future__ import annotations

import torch

from expresslane.triton_setup import tl, triton

BLOCK = 1024


@triton.jit
def _penalize(logits_ptr, counts_ptr, seen_ptr, logit_rows_ptr, state_rows_ptr, rep_ptr, freq_ptr, pres_ptr, vocab,
              stride, BLOCK: tl.constexpr):
    k = tl.program_id(0)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = i < vocab
    lrow = tl.load(logit_rows_ptr + k).to(tl.int64)
    srow = tl.load(state_rows_ptr + k).to(tl.int64)
    rep = tl.load(rep_ptr + k)
    freq = tl.load(freq_ptr + k)
    pres = tl.load(pres_ptr + k)
    x = tl.load(logits_ptr + lrow * stride + i, mask=m, other=0.0)
    c = tl.load(counts_ptr + srow * vocab + i, mask=m, other=0).to(tl.float32)
    s = tl.load(seen_ptr + srow * vocab + i, mask=m, other=0)
    x = tl.where(s != 0, tl.where(x > 0, tl.math.div_rn(x, rep), x * rep), x)
    x = x - freq * c - tl.where(c > 0, pres, 0.0)
    tl.store(logits_ptr + lrow * stride + i, x, mask=m)


def penalize(logits: torch.Tensor, counts: torch.Tensor, seen: torch.Tensor, logit_rows: torch.Tensor,
             state_rows: torch.Tensor, rep: torch.Tensor, freq: torch.Tensor, pres: torch.Tensor) -> None:
    """In place on rows ``logit_rows``, with the counts of ``state_rows``."""
    vocab = logits.shape[1]
    grid = (len(logit_rows), triton.cdiv(vocab, BLOCK))
    _penalize[grid](logits, counts, seen, logit_rows, state_rows, rep, freq, pres, vocab, logits.stride(0),
                    BLOCK=BLOCK)
