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
        """Shared memory of the key loop's pipeline: a K and a V tile per stage (what Triton
        asked for when r128-n128 failed in float32 on the H200: 2 x 2 x 128 x 128 x 4 bytes)."""
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
# Measured winners (H200, head dim 128, bf16; docs/performance.md): prefill r128-n128-w8 from 1024
# tokens (2026-12-01, `gpu.sh kernels` and `longctx`: 350 vs 325 TFLOP/s for a 2048 chunk after 30k
# cached; 32k TTFT 1683 -> 1558 ms) and below (2026-12-03, `SPLIT_TILES=1 gpu.sh split`: chunks of
# 24-512 tokens after 8k / 32k keys 8-23% faster than r64-n64-w4, fresh prompts of 256 / 512 tokens
# +1.3 / -0.3 us a layer); decode at batch 1 up to 64 splits (4 waves: 64 on an H200 for
# 8 KV heads, a few in the interpreter; 43.9 vs 68.6 us per layer at 32k; ITL 6.63 -> 5.85 ms). 8 splits at batch >= 32 won at 64 x 8k (532 vs 556 us) but
# lost at 1k context (step 7.5 -> 8.7 ms), so it is not taken. The other keys and head dim 64 keep
# the old shape until measured. A tile whose K/V pipeline does not fit the GPU's shared memory
# (r128-n128 over a float32 cache) falls back to the default (TritonAttentionBackend.prefill_tile).
_P, _D = PrefillTile(), DecodeTile()
_P_LONG = PrefillTile(rows=128, block_n=128, num_warps=8)
PREFILL_TILES: Table = {64: ((0, _P), (1024, _P), (4096, _P), (16384, _P)),
                        128: ((0, _P_LONG), (1024, _P_LONG), (4096, _P_LONG), (16384, _P_LONG))}
DECODE_TILES: Table = {64: ((1, _D), (2, _D), (32, _D)),
                       128: ((1, DecodeTile(max_splits=64, waves=4)), (2, _D), (32, _D))}
# An FP8 cache (H200, 2026-12-02, `gpu.sh gemv`: kv_attention_bench, batch 64 x 8k, head dim 128):
# 128-key tiles over 8 warps, 2 stages, 472 us against 544 for the bf16 table's tile (which stays
# best for bf16: 496-510 us); fewer stages (the idea that the 8-bit operands' byte-wide shared-memory
# reads were the cost) did not win: 505-729 us at 1 stage. Other batch sizes keep the bf16 tiles.
FP8_DECODE_TILES: Table = {64: DECODE_TILES[64],
                           128: DECODE_TILES[128][:2] + ((32, DecodeTile(block_n=128, num_warps=8, num_stages=2)),)}


def pick(table: Table, d_pad: int, key: int, default):
    """The table's tile for this padded head dim and key; `default` for a head dim it lacks."""
    tile = default
    for low, entry in table.get(d_pad, ()):
        if key >= low:
            tile = entry
    return tile
