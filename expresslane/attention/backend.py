"""The attention-backend interface: one metadata object per step, shared by all layers.

A step's tokens are flattened, decodes first (one query token each), then prefill
chunks (any number of query tokens, attending to the cached prefix and causally to
themselves)::

    tokens   [d0 d1 d2 | p0 p0 p0 p0 | p1 p1]      num_decodes = 3
    seqs      0  1  2    3             4
    query_start_loc = [0, 1, 2, 3, 7, 9]
    seq_lens        = context length of each seq after this step (cached + new)

The KV cache of one layer is a tensor [2, num_blocks, block_size, num_kv_heads,
head_dim]; token t of a seq lives in block ``block_tables[seq, t // block_size]`` at
offset ``t % block_size``, and ``slot_mapping`` holds ``block * block_size + offset``
for every new token. An FP8 cache (float8_e4m3fn) holds k / k_scale and v / v_scale
(``kv_scales``, per layer), clamped to +-448 and rounded to nearest; readers multiply back.

A layer calls ``store`` (RoPE on q and k, the new k/v of every token into the cache),
then ``attend``. Invariant for every backend: the step's new k/v of *all* seqs are
written before any seq reads the cache, because a prefix-cache hit may point at
blocks that another seq computes in this very step.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    seq_lens: torch.Tensor  # [B] int32
    query_start_loc: torch.Tensor  # [B + 1] int32
    num_decodes: int
    # host copies: the reference backend loops over prefill seqs without a device sync
    seq_lens_cpu: list[int]
    query_start_loc_cpu: list[int]
    max_decode_seq_len: int
    # filled by the backend's prepare(): decode tile shape and split count, prefill tile shape and work list
    num_splits: int = 1
    decode_tile: object | None = None
    prefill_tile: object | None = None
    prefill_work: torch.Tensor | None = None
    library_seqs: tuple[int, ...] = ()  # prefill seqs a library kernel runs (eager steps only), not the work list


class AttentionBackend(Protocol):
    supports_cuda_graphs: bool
    fused_ops: bool  # the model's RMSNorm and SiLU-and-mul use the fused Triton kernels too

    def prepare(self, meta: AttentionMetadata) -> None:
        """Once per step, before the model runs: derive backend-specific metadata."""
        ...

    def store(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rotary,
              kv_cache: torch.Tensor, meta: AttentionMetadata,
              kv_scales: tuple[float, float] = (1.0, 1.0), qk_norm=None) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hk, D]: normalise each q and k head by `qk_norm` (q_norm, k_norm:
        RMSNorm over the head dim, Qwen3) when given, rotate q and k by `rotary` (a
        RotaryEmbedding) at `positions`, write k/v into the cache; returns the rotated q."""
        ...

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
               kv_scales: tuple[float, float] = (1.0, 1.0)) -> torch.Tensor:
        """Attention of the step's (rotated) queries over the cache: [T, Hq, D]."""
        ...


def get_backend(name: str, num_heads: int, num_kv_heads: int, head_dim: int,
                device: torch.device, kv_dtype: torch.dtype = torch.bfloat16,
                prefill_library: str = "triton") -> AttentionBackend:
    """`kv_dtype`: the KV cache's element type (the Triton tiles' shared memory depends on it);
    `prefill_library`: who runs long prefill chunks in the triton backend (library_prefill.py)."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        if prefill_library == "cudnn":  # auto: the torch backend has one prefill path
            raise ValueError(f"prefill_attention {prefill_library!r} needs the triton attention backend (the torch "
                             "backend has one prefill path)")
        from expresslane.attention.torch_backend import TorchAttentionBackend
        return TorchAttentionBackend()
    if name == "triton":
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("attention_backend 'triton' needs a CUDA device (on CPU only through Triton's "
                             "interpreter, TRITON_INTERPRET=1, for tests); use 'torch' or 'auto'")
        from expresslane.attention.triton_backend import TritonAttentionBackend
        return TritonAttentionBackend(num_heads, num_kv_heads, head_dim, device, kv_dtype=kv_dtype,
                                      prefill_library=prefill_library)
    raise ValueError(f"unknown attention backend {name!r} (available: torch, triton)")
