"""The `triton` attention backend: paged kernels, CUDA-graph friendly decode.

Decode seqs run split-KV (grid: seq x KV head x split, then a reduction), with the
number of splits and the tile fixed by the batch size alone so a captured graph replays
with any context lengths. Prefill chunks run one program per (seq, tile of query tokens,
KV head), and for an item with more keys than the launch's fair share of a program, per
slice of its keys too (`plan_prefill`); `prepare` picks the step's prefill tile by its prefill tokens
(triton_tiles.py) and builds the work list, the items with the most keys first. With `prefill_library`
"cudnn", prefill seqs of at least `LIBRARY_MIN_TOKENS` query tokens run through cuDNN
instead (library_prefill.py), in eager steps (`eager_step`); with "auto", only seqs of at
least `AUTO_MIN_TOKENS` query tokens and `AUTO_MIN_CONTEXT` keys do.
"""

from __future__ import annotations


import numpy as np
import torch

from expresslane.attention.backend import AttentionBackend, AttentionMetadata
from expresslane.attention.library_prefill import LIBRARIES, seq_attention, warm_plans
from expresslane.attention.triton_kernels import paged_attention_kernel, reduce_splits_kernel, rope_store_kernel
from expresslane.attention.triton_tiles import DECODE_TILES, FP8_DECODE_TILES, PREFILL_TILES, DecodeTile, PrefillTile, Table, pick
from expresslane.device import arrival_counters, current_scratch, to_device
from expresslane.triton_setup import rows_per_program, triton


def _pow2(n: int) -> int:
    return 1 << (max(n, 1) - 1).bit_length()


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter on CPU: still exercise several splits


def _smem_bytes(device: torch.device) -> int | None:
    """Shared memory a program may use (None: no limit, the interpreter)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).shared_memory_per_block_optin
    return None


class TritonAttentionBackend(AttentionBackend):
    supports_cuda_graphs = True
    fused_ops = True
    LIBRARY_MIN_TOKENS = 512  # query tokens of a prefill seq that the library runs (prefill_library "cudnn")
    # "auto": where cuDNN beats our kernel (docs/architecture.md, "Library prefill"):
    # 1,024+ query tokens over 4,096+ keys (a chunk after cached keys or a whole prompt); shorter
    # chunks or contexts stay on the kernel, and in the CUDA graphs
    AUTO_MIN_TOKENS = 1024
    AUTO_MIN_CONTEXT = 4096
    SPLIT_MIN_KEYS = 512  # keys a slice of a split prefill item has at least
    MAX_PREFILL_SPLITS = 16  # slices of one item at most
    SPLIT_WAVES = 2  # split items fill about this many waves of programs

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, device: torch.device,
                 prefill_tiles: Table | None = None, decode_tiles: Table | None = None,
                 kv_dtype: torch.dtype = torch.bfloat16, smem_bytes: int | None = None,
                 prefill_library: str = "triton", window: int | None = None):
        """`window`: the sliding window of every layer, if they all have one: the prefill work list
        then counts the keys of an item's window only (its order and splits)."""
        if prefill_library not in LIBRARIES:
            raise ValueError(f"prefill_attention must be one of {', '.join(LIBRARIES)}, got {prefill_library!r}")
        # auto only where it was measured (Hopper), or on the interpreter, whose CPU stand-in the tests
        # run; the library reads the cache as it is: not an FP8 one (its scales are ours)
        self.auto = prefill_library == "auto"
        if self.auto and device.type == "cuda":
            hopper = torch.backends.cudnn.is_available() and torch.cuda.get_device_capability(device) >= (9, 0)
            prefill_library = "auto" if hopper else "triton"
        self.library = prefill_library != "triton" and kv_dtype.itemsize > 1
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.window = window
        self.group = num_heads // num_kv_heads
        self.g_pad = _pow2(self.group)
        self.d_pad = max(16, _pow2(head_dim))
        self.decode_q = max(1, 16 // self.g_pad)  # tl.dot needs >= 16 rows; extra rows are masked
        self.interpreted = device.type != "cuda"  # Triton's interpreter: steps time Python, not a device
        self.sms = _num_sms(device)
        self.kv_itemsize = kv_dtype.itemsize
        self.smem = _smem_bytes(device) if smem_bytes is None else smem_bytes
        self._partial_bufs: dict[tuple[int, int, int, str | None], tuple[torch.Tensor, torch.Tensor]] = {}
        # tile tables (triton_tiles.py); a benchmark passes its own to sweep shapes
        self.prefill_tiles = PREFILL_TILES if prefill_tiles is None else prefill_tiles
        if decode_tiles is None:
            decode_tiles = FP8_DECODE_TILES if self.kv_itemsize == 1 else DECODE_TILES
        self.decode_tiles = decode_tiles

    def prefill_tile(self, num_tokens: int) -> PrefillTile:
        """The tile of a step with `num_tokens` prefill tokens (a mixed graph: its bucket size); the
        default where the table's would not fit the shared memory with this cache's element size."""
        tile = pick(self.prefill_tiles, self.d_pad, num_tokens, PrefillTile())
        if self.smem is not None and tile.kv_smem_bytes(self.d_pad, self.kv_itemsize) > self.smem:
            return PrefillTile()
        return tile

    def decode_tile(self, num_decodes: int) -> DecodeTile:
        """The table's tile for a decode batch."""
        return pick(self.decode_tiles, self.d_pad, num_decodes, DecodeTile())

    def block_q(self, tile: PrefillTile) -> int:
        """Query tokens per prefill program: the tile's rows over the padded group (at least one)."""
        return max(1, tile.rows // self.g_pad)

    def num_splits(self, num_decodes: int) -> int:
        """Enough programs to fill the GPU `waves` times; depends on the batch size only."""
        tile = self.decode_tile(num_decodes)
        want = -(-tile.waves * self.sms // max(1, num_decodes * self.num_kv_heads))
        return max(1, min(tile.max_splits, want))

    def plan_prefill(self, query_start_loc, seq_lens, first_seq: int, tile: PrefillTile) -> np.ndarray:
        """The prefill launch's work list, [W, 5] int32 rows (seq, first query token, split,
        splits, partial slot): one item per tile of a seq's query tokens, in decreasing order
        of the keys they attend to, so the longest start first and the launch does not end on
        a late long one (each item writes its own rows: the order changes no result).

        An item is cut into slices of its keys when one program walking them all would outlast
        the launch's fair share (a short chunk after a long context: a few programs each read
        thousands of keys; a decode at 8k keys beside a short prompt in a mixed step): slices of at least `SPLIT_MIN_KEYS` keys and of
        the keys that `SPLIT_WAVES` waves of programs would each read if all were spread evenly,
        at most `MAX_PREFILL_SPLITS` per item. Their slots never exceed `split_rows` (the slices
        hold at most all keys over the slice length); an item's slices are adjacent and share
        `splits` slots from `slot` on."""
        qsl = np.asarray(query_start_loc, dtype=np.int64)[first_seq:]
        bq = self.block_q(tile)
        q_lens = qsl[1:] - qsl[:-1]
        tiles = -(-q_lens // bq)
        seq = np.repeat(np.arange(first_seq, first_seq + len(tiles)), tiles)
        q_off = (np.arange(len(seq)) - np.repeat(np.cumsum(tiles) - tiles, tiles)) * bq
        ctx = np.repeat(np.asarray(seq_lens, dtype=np.int64)[first_seq:first_seq + len(tiles)], tiles)
        first = ctx - np.repeat(q_lens, tiles) + q_off  # the item's first query position
        keys = np.minimum(ctx, first + bq)
        if self.window is not None:
            keys -= np.maximum(first - self.window + 1, 0)
        order = np.argsort(-keys, kind="stable")
        seq, q_off, keys = seq[order], q_off[order], keys[order]
        fair = -(-int(keys.sum()) * self.num_kv_heads // (self.SPLIT_WAVES * self.sms))
        splits = np.clip(keys // max(self.SPLIT_MIN_KEYS, fair), 1, self.MAX_PREFILL_SPLITS)
        slots = np.where(splits > 1, splits, 0)  # partial slots each item takes
        slot = np.cumsum(slots) - slots
        split = np.arange(int(splits.sum())) - np.repeat(np.cumsum(splits) - splits, splits)
        rows = [np.repeat(seq, splits), np.repeat(q_off, splits), split, np.repeat(splits, splits),
                np.repeat(slot, splits)]
        return np.stack(rows, axis=1).astype(np.int32)

    @property
    def split_rows(self) -> int:
        """Partial slots of split prefill items: `SPLIT_WAVES` waves of programs (`plan_prefill`'s
        slices never take more: each has at least the keys of a fair share over that many)."""
        return max(1, self.SPLIT_WAVES * self.sms // self.num_kv_heads)

    def max_prefill_work(self, num_tokens: int, num_seqs: int) -> int:
        """Work items a step of this many tokens and seqs may have (a captured launch's grid):
        its tiles of query tokens, and the slices that split ones add (fewer than `split_rows`)."""
        return num_tokens // self.block_q(self.prefill_tile(num_tokens)) + num_seqs + self.split_rows

    def _partials(self, bq: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The split prefill items' partial results (acc; m and l) for tiles of `bq` query
        tokens: one buffer, reused by every layer and step (launches on one stream do not
        overlap; each combines its own before it ends). Allocated on first use, which the
        CUDA-graph warm-up does before capture."""
        shape = (self.split_rows, bq, self.num_heads)
        key = (*shape, current_scratch())
        if key not in self._partial_bufs:
            self._partial_bufs[key] = (torch.empty(*shape, self.d_pad, dtype=torch.float32, device=device),
                                       torch.empty(*shape, 2, dtype=torch.float32, device=device))
        return self._partial_bufs[key]

    def library_seqs(self, query_start_loc, seq_lens, num_decodes: int) -> tuple[int, ...]:
        """The step's prefill seqs that the library runs (none without `prefill_library`)."""
        if not self.library:
            return ()
        tokens = np.diff(np.asarray(query_start_loc, dtype=np.int64)[num_decodes:])
        if self.auto:
            take = (tokens >= self.AUTO_MIN_TOKENS) & (np.asarray(seq_lens)[num_decodes:] >= self.AUTO_MIN_CONTEXT)
        else:
            take = tokens >= self.LIBRARY_MIN_TOKENS
        return tuple(int(i) + num_decodes for i in np.flatnonzero(take))

    def warm_library(self, dtype: torch.dtype, device: torch.device, max_model_len: int, budget: int) -> int:
        """cuDNN's plans for the library's common shapes, built at start-up on a GPU (a plan met
        first mid-run stalls its step); the number built."""
        if not self.library or device.type != "cuda" or max_model_len < self.AUTO_MIN_CONTEXT:
            return 0
        return warm_plans(self.num_heads, self.num_kv_heads, self.head_dim, dtype, device, max_model_len, budget,
                          self.head_dim ** -0.5)

    def eager_step(self, query_start_loc, seq_lens, num_decodes: int) -> bool:
        """A step the CUDA graphs must not take: the library runs one of its seqs (its shapes
        follow the seq's length)."""
        return bool(self.library_seqs(query_start_loc, seq_lens, num_decodes))

    def prepare(self, meta: AttentionMetadata) -> None:
        """Per-step, host-side: the decode tile and split count (by batch size), the prefill
        tile (by prefill tokens) and work list, without the seqs the library runs."""
        nd = meta.num_decodes
        meta.decode_tile, meta.num_splits = self.decode_tile(nd), self.num_splits(nd)
        qsl = meta.query_start_loc_cpu
        meta.library_seqs = self.library_seqs(qsl, meta.seq_lens_cpu, nd)
        meta.prefill_work = None
        if len(qsl) > nd + 1:
            meta.prefill_tile = self.prefill_tile(qsl[-1] - qsl[nd])
            work = self.plan_prefill(qsl, meta.seq_lens_cpu, nd, meta.prefill_tile)
            if meta.library_seqs:
                work = work[~np.isin(work[:, 0], meta.library_seqs)]
            if len(work):
                meta.prefill_work = to_device(work, torch.int32, meta.seq_lens.device)

    def store(self, positions, q, k, v, rotary, kv_cache, meta: AttentionMetadata,
              kv_scales=(1.0, 1.0), qk_norm=None) -> torch.Tensor:
        """q/k RMSNorm (if any), RoPE on q and k and the KV-cache write in one kernel (one
        program per token when compiled)."""
        t = q.shape[0]
        q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if t:
            cs, rows = rotary.lookup(positions, meta.rope_lengths)
            half = cs.shape[1] // 2
            rest = self.head_dim - 2 * half  # partial rotary: dims copied as they are
            if rest and qk_norm is not None:
                raise ValueError("q/k RMSNorm with partial rotary is not supported by the triton backend")
            qn, kn = (q, q) if qk_norm is None else (qk_norm[0].weight, qk_norm[1].weight)
            per = rows_per_program(t)
            rope_store_kernel[(triton.cdiv(t, per),)](
                q, k, v, rows, meta.slot_mapping, cs, q_out, kv_cache, qn, kn,
                q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cs.stride(0),
                kv_cache.stride(0), kv_cache.stride(2), kv_cache.stride(3), *kv_scales,
                0.0 if qk_norm is None else qk_norm[0].eps, t,
                HQ=self.num_heads, HK=self.num_kv_heads, HALF=half, HQ_PAD=_pow2(self.num_heads),
                HK_PAD=_pow2(self.num_kv_heads), HALF_PAD=_pow2(half), KV_FP8=kv_cache.dtype == torch.float8_e4m3fn,
                QK_NORM=qk_norm is not None, NORM_OFFSET=qk_norm is not None and qk_norm[0].offset,
                HEAD_DIM=self.head_dim, REST_PAD=_pow2(rest) if rest else 0,
                TOKENS=per)
        return q_out

    def attend(self, q, kv_cache, meta: AttentionMetadata, scale: float, kv_scales=(1.0, 1.0),
               softcap: float | None = None, window: int | None = None,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        if (softcap is not None or window is not None or sinks is not None) and meta.library_seqs:
            raise ValueError("the library prefill path has no soft-cap (attn_logit_softcapping), no sliding "
                             "window and no attention sinks; use prefill_attention 'triton'")
        hk, d = self.num_kv_heads, self.head_dim
        out = torch.empty_like(q)
        kc, vc = kv_cache[0], kv_cache[1]
        common = dict(G=self.group, G_PAD=self.g_pad, HK=hk, HEAD_DIM=d, D_PAD=self.d_pad,
                      PAGE=kc.shape[1], HAS_WINDOW=window is not None,
                      # float32 means "reference accuracy": no TF32 rounding of the dot operands
                      PRECISION="ieee" if q.dtype == torch.float32 else "tf32", SOFTCAP=softcap is not None,
                      HAS_SINKS=sinks is not None)
        sinks_arg = q if sinks is None else sinks  # (any pointer when there are none: not read)
        strides = (q.stride(0), q.stride(1), kc.stride(0), kc.stride(1), kc.stride(2), out.stride(0), out.stride(1),
                   meta.block_tables.stride(0))
        nd = meta.num_decodes
        counters = arrival_counters(q.device)  # one per (seq or partial slot, KV head) when splits combine themselves
        if nd:
            s, tile = meta.num_splits, meta.decode_tile
            if tile.fused_reduce and nd * hk > counters.numel():
                raise ValueError(f"{nd} decodes x {hk} KV heads exceed the {counters.numel()} arrival counters")
            part_acc = torch.empty(nd, self.num_heads, s, self.d_pad, dtype=torch.float32, device=q.device)
            part_ml = torch.empty(nd, self.num_heads, s, 2, dtype=torch.float32, device=q.device)
            paged_attention_kernel[(nd, hk, s)](
                q, kc, vc, out, part_acc, part_ml, counters, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                meta.seq_lens, sinks_arg, scale, s, *kv_scales, softcap or 1.0, window or 0,
                *strides,  # partials: slot = seq
                part_acc.stride(0), part_acc.stride(2), 0, part_acc.stride(1),
                part_ml.stride(0), part_ml.stride(2), 0, part_ml.stride(1),
                BLOCK_Q=self.decode_q, BLOCK_N=tile.block_n, DECODE=True, MASK_ALL=tile.mask_all,
                FUSED_REDUCE=tile.fused_reduce, num_warps=tile.num_warps, num_stages=tile.num_stages, **common)
            if not tile.fused_reduce and s > 1:  # one split wrote the output itself
                reduce_splits_kernel[(nd, self.num_heads)](
                    part_acc, part_ml, out, s, part_acc.stride(0), part_acc.stride(1), part_ml.stride(0),
                    out.stride(0), out.stride(1), HEAD_DIM=d, D_PAD=self.d_pad, MAX_SPLITS=_pow2(tile.max_splits))
        if meta.prefill_work is not None:
            tile, bq = meta.prefill_tile, self.block_q(meta.prefill_tile)
            acc, ml = self._partials(bq, q.device)  # partials: slot + split, token, head
            paged_attention_kernel[(meta.prefill_work.shape[0] * hk,)](
                q, kc, vc, out, acc, ml, counters, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                meta.prefill_work, sinks_arg, scale, 1, *kv_scales, softcap or 1.0, window or 0, *strides,
                acc.stride(0),
                acc.stride(0), acc.stride(1), acc.stride(2), ml.stride(0), ml.stride(0), ml.stride(1), ml.stride(2),
                BLOCK_Q=bq, BLOCK_N=tile.block_n, DECODE=False, MASK_ALL=tile.mask_all,
                FUSED_REDUCE=False,
                num_warps=tile.num_warps, num_stages=tile.num_stages, **common)
        for i in meta.library_seqs:
            seq_attention(q, kv_cache, meta, i, scale, out)
        return out
