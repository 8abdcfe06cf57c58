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
then ``attend`` (with the layer's sliding window, if it has one). Invariant for every backend: the step's new k/v of *all* seqs are
written before any seq reads the cache, because a prefix-cache hit may point at
blocks that another seq computes in this very step.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, replace

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
    # [T] int64, each token's request's RoPE length (its prompt's; the sequence's once a longrope
    # request restarted): for RoPE whose frequencies follow the length (layers/rotary.py)
    rope_lengths: torch.Tensor | None = None
    # with layers in several KV groups (attention/kv_groups.py): each group's copy, its own slot
    # mapping and block tables; the fields above are group 0's
    kv_groups: tuple[AttentionMetadata, ...] = ()

    def group(self, index: int) -> AttentionMetadata:
        return self.kv_groups[index] if self.kv_groups else self

    def with_groups(self, slot_mapping: torch.Tensor, block_tables: torch.Tensor) -> AttentionMetadata:
        """After `prepare`: a copy per group from [G, T] slots and [G, B, W] tables (G > 1)."""
        if len(slot_mapping) > 1:
            self.kv_groups = tuple(replace(self, slot_mapping=slots, block_tables=tables)
                                   for slots, tables in zip(slot_mapping, block_tables))
        return self


class AttentionBackend(ABC):
    """What the model, the runner and the CUDA graphs call on an attention backend
    (``attention/registry.py`` picks one)."""

    supports_cuda_graphs: bool = False  # then the graph hooks below are implemented
    fused_ops: bool = False  # the model's RMSNorm and SiLU-and-mul use the fused Triton kernels too
    interpreted: bool = False  # kernels run under Triton's interpreter: step times say nothing of a device

    @abstractmethod
    def prepare(self, meta: AttentionMetadata) -> None:
        """Once per step, before the model runs: derive backend-specific metadata."""

    @abstractmethod
    def store(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rotary,
              kv_cache: torch.Tensor, meta: AttentionMetadata,
              kv_scales: tuple[float, float] = (1.0, 1.0), qk_norm=None) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hk, D]: normalise each q and k head by `qk_norm` (q_norm, k_norm:
        RMSNorm over the head dim, Qwen3; or GemmaRMSNorm, whose `offset` says so) when given,
        rotate q and k by `rotary` (a RotaryEmbedding) at `positions` (its rows: `rotary.lookup(positions, meta.rope_lengths)`),
        write k/v into the cache; returns the rotated q."""

    @abstractmethod
    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
               kv_scales: tuple[float, float] = (1.0, 1.0), softcap: float | None = None,
               window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of the step's (rotated) queries over the cache: [T, Hq, D]. `softcap` (Gemma 2's
        attn_logit_softcapping): each scaled score s becomes softcap * tanh(s / softcap) before the softmax.
        `window` (the layer's sliding window): a query at position p sees keys p - window < j <= p, and
        the blocks wholly before that are not read (the KV manager may have freed them). `sinks` [Hq]
        (gpt-oss): a learned logit per query head that joins the softmax's denominator, e^sink added
        to the sum of e^score, with no value (the weights of the keys then sum to less than 1)."""

    def warm_library(self, dtype: torch.dtype, device: torch.device, max_model_len: int, budget: int) -> int:
        """Build a library kernel's plans before serving (eager steps); returns how many (0: none)."""
        return 0

    def eager_step(self, query_start_loc, seq_lens, num_decodes: int) -> bool:
        """Whether a step must run eagerly although a graph fits it (a library kernel runs it)."""
        return False

    # -- CUDA-graph hooks (supports_cuda_graphs) ---------------------------------------------------
    def prefill_tile(self, num_tokens: int):
        """The prefill tile shape a step of ``num_tokens`` uses (fixed per captured graph)."""
        raise NotImplementedError(f"{type(self).__name__} does not run in CUDA graphs")

    def max_prefill_work(self, num_tokens: int, num_seqs: int) -> int:
        """Rows of the prefill work list a graph of that size must hold."""
        raise NotImplementedError(f"{type(self).__name__} does not run in CUDA graphs")

    def plan_prefill(self, query_start_loc, seq_lens, first_seq: int, tile):
        """A step's prefill work list (copied into a graph's static buffer before replay)."""
        raise NotImplementedError(f"{type(self).__name__} does not run in CUDA graphs")
