"""The latent-cache attention kernel (attention/mla_kernels.py) at DeepSeek-V2-Lite's shape: 16
heads a rank, kv_lora_rank 512, rope dims 64, pages of 16, bf16.

- decode: batches 1, 8 and 64 over 1k, 8k and 32k keys each, timed in a CUDA graph of calls that
  cycle over enough layers' caches that L2 holds none between reads: µs per call, the latent bytes
  a call reads ((L + R) x 2 bytes a key) per second, % of the H200's 4.27 TB/s, and the time as a
  multiple of the read floor at this GPU's measured copy bandwidth;
- prefill: one 2048-token chunk after 2048 cached keys: ms and TFLOP/s of the absorbed attention
  (2 x heads x (2L + R) FLOPs per visible query-key pair), % of the 805 TFLOP/s peak;
- --sweep: the decode cases at 8k keys (and batch 64 at 1k) under other launch shapes around the
  table's (`LatentTile`: keys a loop iteration, warps, pipeline stages, key splits), each checked
  first; the fastest per case printed last beside the table's.

Each case first runs a short context against the torch reference (attention/mla.py); a wrong
result stops the benchmark (exit 1).

    python benchmarks/mla_bench.py [--out results.jsonl] [--sweep]
    TRITON_INTERPRET=1 python benchmarks/mla_bench.py --smoke   # CPU: tiny shapes, float32, the checks only
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import torch
from _shared import copy_bandwidth, emit, graph_us

from expresslane.attention.backend import AttentionMetadata
from expresslane.attention.mla import latent_attention
from expresslane.attention.mla_kernels import LatentTile, latent_tile, num_splits, paged_latent_attention
from expresslane.bench.floors import H200_PEAK_BANDWIDTH as PEAK_BW
from expresslane.bench.floors import H200_PEAK_FLOPS as PEAK_FLOPS

HEADS, LATENT, ROPE, PAGE = 16, 512, 64, 16
L2_BYTES = 200 << 20  # the caches a graph cycles over exceed this (the H200's L2 is 50 MiB)


def step(contexts: list[int], new: int, device: torch.device) -> tuple[AttentionMetadata, torch.Tensor, int]:
    """Seqs of `new` query tokens after `contexts[i]` cached ones, each its own run of blocks:
    (metadata, positions, blocks)."""
    per_seq = [-(-(c + new) // PAGE) for c in contexts]
    first = [sum(per_seq[:i]) for i in range(len(per_seq))]
    tables = [[f + j for j in range(max(per_seq))] for f in first]
    lens = [c + new for c in contexts]
    starts = [i * new for i in range(len(contexts) + 1)]
    positions = [p for c in contexts for p in range(c, c + new)]
    slots = [tables[i][p // PAGE] * PAGE + p % PAGE for i, c in enumerate(contexts) for p in range(c, c + new)]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, device=device), block_tables=torch.tensor(tables, dtype=torch.int32,
                                                                                   device=device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        num_decodes=len(contexts) if new == 1 else 0, seq_lens_cpu=lens, query_start_loc_cpu=starts,
        max_decode_seq_len=max(lens) if new == 1 else 0)
    return meta, torch.tensor(positions, device=device), sum(per_seq)


def inputs(contexts: list[int], new: int, dtype: torch.dtype, device: torch.device, layers: int = 1):
    meta, positions, blocks = step(contexts, new, device)
    t = len(positions)
    caches = [torch.randn(blocks, PAGE, LATENT + ROPE, dtype=dtype, device=device) for _ in range(layers)]
    q_lat = torch.randn(t, HEADS, LATENT, dtype=dtype, device=device)
    q_pe = torch.randn(t, HEADS, ROPE, dtype=dtype, device=device)
    return meta, positions, caches, q_lat, q_pe


def check(contexts: list[int], new: int, dtype: torch.dtype, device: torch.device,
          tile: LatentTile | None = None) -> None:
    meta, positions, [cache], q_lat, q_pe = inputs(contexts, new, dtype, device)
    scale = (128 + ROPE) ** -0.5
    got = paged_latent_attention(q_lat, q_pe, cache, positions, meta, scale, tile).float()
    want = latent_attention(q_lat.float(), q_pe.float(), cache.float(), meta, scale)
    err = ((got - want).norm() / want.norm()).item()
    if err > 2e-2:
        sys.exit(f"latent attention of {len(contexts)} seqs x {new} tokens after {contexts[0]} ({tile}): "
                 f"relative error {err}")


def decode(batch: int, context: int, copy_bw: float, out, tile: LatentTile | None = None, sweep: bool = False) -> dict:
    """One decode case under `tile` (None: the table's, as the engine runs it)."""
    dtype, device = torch.bfloat16, torch.device("cuda")
    tile = tile or latent_tile(batch)
    check([min(context, 300)] * batch, 1, dtype, device, tile)
    per_layer = batch * (context + 1) * (LATENT + ROPE) * 2
    layers = max(2, min(64, -(-L2_BYTES // per_layer)))
    meta, positions, caches, q_lat, q_pe = inputs([context] * batch, 1, dtype, device, layers)
    calls = [lambda c=c: paged_latent_attention(q_lat, q_pe, c, positions, meta, 0.07, tile) for c in caches]
    us = graph_us(calls)
    gbs = per_layer / us / 1e3
    return emit(out, case="decode", batch=batch, context=context, tile=str(tile), sweep=sweep,
                splits=num_splits(batch, HEADS, device, tile), us=round(us, 1), gb_per_s=round(gbs, 1),
                pct_bandwidth=round(100 * gbs * 1e9 / PEAK_BW, 1),
                x_of_read_floor=round(copy_bw / (gbs * 1e9), 3))  # floor: the latent bytes at this GPU's copy speed


def sweep_tiles(today: LatentTile) -> list[LatentTile]:
    """Today's tile, the loop shapes at today's splits, then split counts for today's loop."""
    shapes = [dataclasses.replace(today, block_n=n, num_warps=w, num_stages=s)
              for n in (16, 32, 64) for w in (4, 8) for s in (1, 2, 3)]
    splits = [dataclasses.replace(today, max_splits=m, waves=v) for m in (16, 32, 64, 128, 256) for v in (1, 2, 4)]
    return list(dict.fromkeys([today] + shapes + splits))


def sweep(copy_bw: float, out) -> None:
    """Every tile on each decode case; a tile that fails to build (shared memory) is left out."""
    best = []
    for batch, context in ((1, 8192), (8, 8192), (64, 8192), (64, 1024)):
        rows, today = [], latent_tile(batch)
        for tile in sweep_tiles(today):
            try:
                rows.append(decode(batch, context, copy_bw, out, tile, sweep=True))
            except Exception as e:  # noqa: BLE001 - a launch shape this GPU cannot build
                print(f"!!! {tile} at batch {batch} x {context}: {type(e).__name__}: {str(e)[:120]}", file=sys.stderr)
        today = next(r for r in rows if r["tile"] == str(today))
        top = min(rows, key=lambda r: r["us"])
        best.append(emit(out, case="decode_best", batch=batch, context=context, today_tile=today["tile"],
                         today_us=today["us"], today_x_floor=today["x_of_read_floor"], best_tile=top["tile"],
                         best_us=top["us"], best_x_floor=top["x_of_read_floor"], best_splits=top["splits"]))
    print("\n== latent decode: today's tile / the fastest (x the read floor)")
    for r in best:
        print(f"batch {r['batch']:>3} x {r['context']:>5}: {r['today_us']:>7.1f} us ({r['today_x_floor']:.2f}x)  "
              f"{r['best_tile']:>24} {r['best_us']:>7.1f} us ({r['best_x_floor']:.2f}x, {r['best_splits']} splits)")


def prefill(chunk: int, cached: int, out) -> None:
    dtype, device = torch.bfloat16, torch.device("cuda")
    check([64], 200, dtype, device)
    meta, positions, [cache], q_lat, q_pe = inputs([cached], chunk, dtype, device)
    us = graph_us([lambda: paged_latent_attention(q_lat, q_pe, cache, positions, meta, 0.07)], reps=3)
    pairs = chunk * cached + chunk * (chunk + 1) // 2
    tflops = 2 * HEADS * (2 * LATENT + ROPE) * pairs / us / 1e6
    emit(out, case="prefill", chunk=chunk, cached=cached, ms=round(us / 1e3, 3), tflop_per_s=round(tflops, 1),
         pct_peak=round(100 * tflops * 1e12 / PEAK_FLOPS, 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="append result lines (JSON) to this file")
    parser.add_argument("--smoke", action="store_true", help="the reference checks only, tiny, on the CPU")
    parser.add_argument("--sweep", action="store_true", help="decode under other launch shapes (LatentTile)")
    args = parser.parse_args()
    if args.smoke:
        for tile in (None, LatentTile(block_n=16, max_splits=2, waves=1)):
            for contexts, new in (([5, 40], 1), ([3], 1), ([20], 9)):
                check(contexts, new, torch.float32, torch.device("cpu"), tile)
        print("mla kernels match the reference")
        return
    copy_bw = copy_bandwidth()
    emit(args.out, case="copy", tb_per_s=round(copy_bw / 1e12, 3))
    if args.sweep:
        sweep(copy_bw, args.out)
        return
    for batch in (1, 8, 64):
        for context in (1024, 8192, 32768):
            decode(batch, context, copy_bw, args.out)
    prefill(2048, 2048, args.out)


if __name__ == "__main__":
    main()
