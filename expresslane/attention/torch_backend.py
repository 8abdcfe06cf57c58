"""Reference attention over the paged KV cache in plain torch (CPU and CUDA).

Correctness first: decodes are batched (gather each seq's blocks, mask past its
length); prefill chunks run one seq at a time with an offset causal mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from expresslane.attention.backend import AttentionBackend, AttentionMetadata


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
             kv_scales: tuple[float, float] = (1.0, 1.0)) -> None:
    _, num_blocks, block_size, heads, dim = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, heads, dim)
    if kv_cache.dtype == torch.float8_e4m3fn:  # a cast past +-448 would give NaN: clamp first
        # (copied as bytes: index_copy_ has no float8 kernel on CPU)
        k = (k.float() / kv_scales[0]).clamp(-448.0, 448.0).to(kv_cache.dtype).view(torch.uint8)
        v = (v.float() / kv_scales[1]).clamp(-448.0, 448.0).to(kv_cache.dtype).view(torch.uint8)
        flat = flat.view(torch.uint8)
    flat[0].index_copy_(0, slot_mapping, k)
    flat[1].index_copy_(0, slot_mapping, v)


def _dequant(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    return x.to(dtype) * scale if x.dtype == torch.float8_e4m3fn else x


def gather_kv(kv_cache: torch.Tensor, block_tables: torch.Tensor, max_len: int):
    """[B, max_blocks] block ids -> k, v of shape [B, max_len, Hk, D]."""
    num_blocks_needed = -(-max_len // kv_cache.shape[2])
    kv = kv_cache[:, block_tables[:, :num_blocks_needed].long()]  # one gather for k and v
    kv = kv.flatten(2, 3)[:, :, :max_len]
    return kv[0], kv[1]


class TorchAttentionBackend(AttentionBackend):
    supports_cuda_graphs = False  # loops over host-side lengths
    fused_ops = False

    def prepare(self, meta: AttentionMetadata) -> None:
        pass

    def store(self, positions, q, k, v, rotary, kv_cache, meta: AttentionMetadata,
              kv_scales=(1.0, 1.0), qk_norm=None) -> torch.Tensor:
        if qk_norm is not None:
            q, k = qk_norm[0](q), qk_norm[1](k)
        q, k = rotary(positions, q, k, meta.rope_lengths)
        write_kv(kv_cache, k, v, meta.slot_mapping, kv_scales)
        return q

    def attend(self, q, kv_cache, meta: AttentionMetadata, scale: float, kv_scales=(1.0, 1.0),
               softcap: float | None = None, window: int | None = None,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            out[:nd] = self._decode(q[:nd], kv_cache, meta, scale, kv_scales, softcap, window, sinks)
        starts = meta.query_start_loc_cpu
        for i in range(nd, len(starts) - 1):
            lo, hi, ctx = starts[i], starts[i + 1], meta.seq_lens_cpu[i]
            out[lo:hi] = self._prefill(q[lo:hi], kv_cache, meta.block_tables[i:i + 1], ctx, scale, kv_scales, softcap,
                                       window, sinks)
        return out

    @staticmethod
    def _decode(q, kv_cache, meta: AttentionMetadata, scale, kv_scales, softcap, window, sinks):
        nd, max_len = meta.num_decodes, meta.max_decode_seq_len
        lens = meta.seq_lens[:nd, None].long()
        if window is None:
            k, v = gather_kv(kv_cache, meta.block_tables[:nd], max_len)
            valid = torch.arange(max_len, device=q.device)[None, :] < lens
        else:  # each seq's blocks from the first its window reaches (clamped to its last: masked)
            bs = kv_cache.shape[2]
            first = (lens - window).clamp(min=0) // bs
            span = min(-(-(window - 1) // bs) + 1, -(-max_len // bs))
            idx = torch.minimum(first + torch.arange(span, device=q.device), (lens - 1).clamp(min=0) // bs)
            kv = kv_cache[:, meta.block_tables[:nd].gather(1, idx.long()).long()].flatten(2, 3)
            k, v = kv[0], kv[1]
            pos = first * bs + torch.arange(span * bs, device=q.device)
            valid = (pos < lens) & (pos >= lens - window)
        k, v = _dequant(k, kv_scales[0], q.dtype), _dequant(v, kv_scales[1], q.dtype)
        o = _attention(q.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2),  # [B, H, 1, D], [B, Hk, L, D]
                       valid[:, None, None, :], scale, softcap, sinks)
        return o.squeeze(2)

    @staticmethod
    def _prefill(q, kv_cache, block_table, ctx: int, scale, kv_scales, softcap, window, sinks):
        n, bs = q.shape[0], kv_cache.shape[2]
        # keys from the block holding the first query's window start (none before: the KV manager may free them)
        first = 0 if window is None else max(0, ctx - n - window + 1) // bs
        k, v = gather_kv(kv_cache, block_table[:, first:], ctx - first * bs)
        k, v = _dequant(k, kv_scales[0], q.dtype), _dequant(v, kv_scales[1], q.dtype)
        # query j sits at position ctx - n + j and sees keys up to it (and, windowed, after it - window)
        q_pos = torch.arange(ctx - n, ctx, device=q.device)[:, None]
        k_pos = torch.arange(first * bs, ctx, device=q.device)[None, :]
        mask = k_pos <= q_pos
        if window is not None:
            mask &= k_pos > q_pos - window
        o = _attention(q.transpose(0, 1)[None], k[0].transpose(0, 1)[None], v[0].transpose(0, 1)[None], mask,
                       scale, softcap, sinks)
        return o[0].transpose(0, 1)


def _attention(q, k, v, mask, scale: float, softcap: float | None, sinks: torch.Tensor | None = None):
    """q [B, H, Lq, D] over k, v [B, Hk, L, D] (GQA: query head h reads KV head h // (H / Hk)).
    With `softcap`, the scores are capped as transformers' Gemma 2 does: scaled, divided by the
    cap, tanh, times the cap, then masked; softmax in float32 (SDPA has no cap). With `sinks` [H],
    each head's sink is one more column of the softmax, dropped after it (gpt-oss)."""
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf")).float()
    if sinks is None:
        return torch.matmul(torch.softmax(scores, dim=-1).to(q.dtype), v)
    sink = sinks.float()[None, :, None, None].expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(probs.to(q.dtype), v)
