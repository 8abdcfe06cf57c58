"""Multi-head latent attention (DeepSeek-V2 / V3) over a latent KV cache: the cache write and
the attention, in torch (the reference, CPU) and in Triton (``mla_kernels.py``).

    cache    one tensor a layer, [num_blocks, block_size, L + R]: c_kv (L = kv_lora_rank) | k_pe
             (R = qk_rope_head_dim, rotated); slot = block * block_size + offset, as every cache
    absorbed q_lat [T, H, L] (q_nope through W_UK) | q_pe [T, H, R]; a token at position p sees
             the keys at positions <= p: o_lat = softmax(scale (q_lat . c_kv + q_pe . k_pe)) @ c_kv,
             [T, H, L] (the caller applies W_UV)
    expanded (torch prefill) k_nope | v = expand(c_kv) per head, k = [k_nope | k_pe]: ordinary
             causal attention over the seq's context, [n, H, V]

As for every backend, a layer writes the step's new latents of all seqs before any seq reads
the cache (a prefix-cache hit may point at blocks computed in this very step).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from expresslane.attention.backend import AttentionBackend, AttentionMetadata


def gather_latent(cache: torch.Tensor, block_tables: torch.Tensor, length: int) -> torch.Tensor:
    """[B, max_blocks] block ids -> [B, length, L + R]: each seq's first `length` slots."""
    blocks = -(-length // cache.shape[1])
    return cache[block_tables[:, :blocks].long()].flatten(1, 2)[:, :length]


def latent_attention(q_lat: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
                     scale: float) -> torch.Tensor:
    """The reference of the absorbed path for the step's first q_lat.shape[0] tokens (decodes
    batched, prefill seqs one at a time): [T, H, L]."""
    t, lat = q_lat.shape[0], q_lat.shape[-1]
    q = torch.cat([q_lat, q_pe], dim=-1)
    out = q_lat.new_empty(q_lat.shape)
    nd = min(meta.num_decodes, t)
    if nd:
        length = meta.max_decode_seq_len
        kv = gather_latent(cache, meta.block_tables[:nd], length)[:, None]  # [B, 1, len, L + R]
        valid = torch.arange(length, device=q.device)[None, :] < meta.seq_lens[:nd, None].long()
        o = F.scaled_dot_product_attention(q[:nd, :, None], kv, kv[..., :lat], attn_mask=valid[:, None, None],
                                           scale=scale, enable_gqa=True)
        out[:nd] = o.squeeze(2)
    starts = meta.query_start_loc_cpu
    for i in range(nd, len(starts) - 1):
        lo, hi, ctx = starts[i], min(starts[i + 1], t), meta.seq_lens_cpu[i]
        if lo >= t:
            break
        kv = gather_latent(cache, meta.block_tables[i:i + 1], ctx)  # [1, ctx, L + R]
        mask = _causal(starts[i + 1] - lo, ctx, q.device)[:hi - lo]
        o = F.scaled_dot_product_attention(q[lo:hi].transpose(0, 1)[None], kv[:, None], kv[:, None, :, :lat],
                                           attn_mask=mask, scale=scale, enable_gqa=True)
        out[lo:hi] = o[0].transpose(0, 1)
    return out


def expanded_prefill(q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
                     scale: float, expand: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
                     v_dim: int) -> torch.Tensor:
    """The prefill seqs' tokens (after the decodes): each seq's latent context expanded by
    `expand(c_kv [n, L]) -> (k_nope [n, H, N], v [n, H, V])`, then causal attention: [P, H, V]."""
    nd, starts, lat = meta.num_decodes, meta.query_start_loc_cpu, cache.shape[-1] - q_pe.shape[-1]
    out = q_nope.new_empty(starts[-1] - starts[nd], q_nope.shape[1], v_dim)
    for i in range(nd, len(starts) - 1):
        lo, hi, ctx = starts[i], starts[i + 1], meta.seq_lens_cpu[i]
        kv = gather_latent(cache, meta.block_tables[i:i + 1], ctx)[0]
        k_nope, v = expand(kv[:, :lat])
        k = torch.cat([k_nope, kv[:, None, lat:].expand(-1, k_nope.shape[1], -1)], dim=-1)
        q = torch.cat([q_nope[lo:hi], q_pe[lo:hi]], dim=-1)
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                           attn_mask=_causal(hi - lo, ctx, q.device), scale=scale)
        out[lo - starts[nd]:hi - starts[nd]] = o.transpose(0, 1)
    return out


def _causal(n: int, ctx: int, device: torch.device) -> torch.Tensor:
    """[n, ctx]: query j (at position ctx - n + j) sees keys up to its own position."""
    return torch.arange(ctx, device=device)[None, :] <= torch.arange(ctx - n, ctx, device=device)[:, None]


class TorchMLA:
    """The reference: decodes absorbed, prefill chunks expanded (a host loop over seqs)."""

    expands_prefill = True

    def rope_store(self, cache: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor, norm,
                   rotary, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """c_kv through `norm`, RoPE on q_pe [T, H, R] and k_pe [T, R], c_kv | k_pe into each token's
        cache slot; returns q_pe rotated."""
        c_kv = norm(c_kv.contiguous())
        q_pe, k_pe = rotary(positions, q_pe, k_pe[:, None], meta.rope_lengths)
        slots = meta.slot_mapping
        keep = slots >= 0  # (CUDA-graph padding carries -1; eager steps have none)
        cache.view(-1, cache.shape[-1]).index_copy_(0, slots[keep], torch.cat([c_kv, k_pe[:, 0]], dim=-1)[keep])
        return q_pe

    def attend(self, q_lat, q_pe, cache, positions, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """The first q_lat.shape[0] tokens (their positions follow from the seq lengths)."""
        return latent_attention(q_lat, q_pe, cache, meta, scale)


class TritonMLA:
    """One kernel for the latent norm, RoPE and cache write, and one latent-attention kernel, for
    the whole step (decodes and prefill alike): no host sync, so the CUDA graphs capture them."""

    expands_prefill = False

    def rope_store(self, cache, q_pe, c_kv, k_pe, norm, rotary, positions, meta: AttentionMetadata) -> torch.Tensor:
        from expresslane.attention.mla_kernels import rope_store_latent
        return rope_store_latent(cache, q_pe, c_kv, k_pe, norm, rotary, positions, meta)

    def attend(self, q_lat, q_pe, cache, positions, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        from expresslane.attention.mla_kernels import paged_latent_attention
        return paged_latent_attention(q_lat, q_pe, cache, positions, meta, scale)


def mla_for(backend: AttentionBackend) -> TorchMLA | TritonMLA:
    """The MLA path of the model's attention backend: Triton's with the Triton backend."""
    return TritonMLA() if backend.fused_ops else TorchMLA()
