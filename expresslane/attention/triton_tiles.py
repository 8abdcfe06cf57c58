"""Tile shapes of the Triton attention kernels, chosen per step from small tables.

A prefill tile is picked by the head dim and the step's prefill tokens: that is all a
mixed-step CUDA graph knows when it is captured (its token-count bucket), so a captured
step and an eager one of the same size use the same tile. A decode tile is picked by the
head dim and the batch size alone, so a decode graph replays with any context length.

The default entry is the shape the kernels had before the tables (64 query rows, 64 keys per
tile, Triton's default 4 warps and 3 stages; decode: up to 16 splits for about two waves of
programs); an entry changes when a GPU run of ``benchmarks/attention_bench.py`` (``bash
benchmarks/gpu.sh kernels``) measures a better one (the comment above the tables says which).
"""

from __future__ import annotations

from dataclasses import dataclass


def _check_pow2(name: str, value: int, low: int) -> None:
    if value < low or value & (value - 1):
        raise ValueError(f"{name} must be a power of two >= {low}, got {value}")


@dataclass(frozen=True)
class PrefillTile:
    rows: int = 64  # query rows per program: tokens x the KV head's (padded) query-head group
    block_n: int = 64  # keys per inner-loop tile
    num_warps: int = 4
    num_stages: int = 3  # software-pipelining depth of the key loop (Triton's default on CUDA)
    mask_all: bool = False  # mask every key tile, not only those crossing the diagonal

    def __post_init__(self):
        _check_pow2("rows", self.rows, 16)
        _check_pow2("block_n", self.block_n, 16)

    def kv_smem_bytes(self, d_pad: int, kv_itemsize: int) -> int:
        """Shared memory of the key loop's pipeline: a K and a V tile per stage."""
        return self.num_stages * 2 * self.block_n * d_pad * kv_itemsize


@dataclass(frozen=True)
class DecodeTile:
    max_splits: int = 16  # split-KV: at most this many programs per (seq, KV head)
    waves: int = 2  # aim for waves x SMs programs in all
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3
    mask_all: bool = False  # mask every key tile, not only a split's ragged end
    fused_reduce: bool = False  # the last split to finish combines them (no reduction kernel)

    def __post_init__(self):
        if self.max_splits < 1 or self.waves < 1:
            raise ValueError(f"max_splits and waves must be >= 1, got {self.max_splits}, {self.waves}")
        _check_pow2("block_n", self.block_n, 16)


# {padded head dim: ((smallest key, tile), ...)} in increasing key order; the last entry whose
# key is <= the step's wins. Prefill key: the step's prefill tokens; decode key: the batch size.
# Entries that repeat a tile keep their key ranges: attention_bench.py suggests a tile per range.
Table = dict[int, tuple[tuple[int, object], ...]]
# Head dim 128 takes the measured winners (docs/architecture.md, "Triton attention kernels"); 64 keeps
# the defaults; 256 (Gemma 2/3) decodes with two stages, the best over batch 1-64 and 1k-4k keys
# (`attention_bench.py --shape 16:8:256`, docs/performance.md). A tile whose K/V pipeline does not
# fit shared memory (r128-n128 over a float32 cache) falls back to the default
# (TritonAttentionBackend.prefill_tile).
_P, _D = PrefillTile(), DecodeTile()
_P_LONG = PrefillTile(rows=128, block_n=128, num_warps=8)
PREFILL_TILES: Table = {64: ((0, _P), (1024, _P), (4096, _P), (16384, _P)),
                        128: ((0, _P_LONG), (1024, _P_LONG), (4096, _P_LONG), (16384, _P_LONG))}
DECODE_TILES: Table = {64: ((1, _D), (2, _D), (32, _D)),
                       128: ((1, DecodeTile(max_splits=64, waves=4)), (2, _D), (32, _D)),
                       256: ((1, DecodeTile(num_stages=2)),)}
# An FP8 cache at batch 32+ and head dim 128: 128-key tiles over 8 warps, 2 stages (measured).
FP8_DECODE_TILES: Table = {64: DECODE_TILES[64],
                           128: DECODE_TILES[128][:2] + ((32, DecodeTile(block_n=128, num_warps=8, num_stages=2)),)}


def pick(table: Table, d_pad: int, key: int, default):
    """The table's tile for this padded head dim and key; `default` for a head dim it lacks."""
    tile = default
    for low, entry in table.get(d_pad, ()):
        if key >= low:
            tile = entry
    return tile
