"""A short prefill chunk after a long context, one layer of the Llama-3-8B shape, bf16: the
prefill kernel with its items whole (one program per tile of query tokens and KV head, each
reading every key) against items cut over their keys (``plan_prefill``'s split: about
``SPLIT_WAVES`` waves of programs, the last slice to finish combining them), at the default
and at more waves and slices (``VARIANTS``). Such steps are what a
latency-first scheduler makes while decodes run beside a long prompt: a few dozen tokens of
it at a time. Timed in CUDA graphs cycling over enough layers' caches that L2 holds none:
microseconds, KV TB/s and % of the H200's copy bandwidth; each output first checked against
float32 attention; TFLOP/s too (a chunk of a few hundred tokens is compute-bound). ``--tiles``:
instead, chunks of 24-1024 tokens after 8k / 32k keys, the default split under other tiles (rows,
keys per loop step, warps, pipeline stages): is a program's slow walk over its keys the
tile's, and which tile suits a lone long prompt's bounded chunks?

    python benchmarks/split_prefill_bench.py [--tiles] [--out results.jsonl]
"""

from __future__ import annotations

import argparse

import torch
from _shared import emit
from attention_bench import (DIM, HEADS, KV_HEADS, TOL, Clock, cold_caches, ms_per_layer, name, only, paged,
                             reference, rel_err, wrong)

from expresslane.attention.triton_backend import TritonAttentionBackend
from expresslane.attention.triton_tiles import PrefillTile
from expresslane.bench.floors import H200_PEAK_BANDWIDTH as PEAK_BW

CASES = [(q, ctx) for ctx in (8192, 32768) for q in (16, 24, 64, 256)]  # (chunk tokens, keys with the chunk)
# --tiles: the chunks a lone long prompt's bounded steps and a mixed step's room take (and fresh prompts
# of the same sizes, which share their graphs' tile), default split vs tiles
TILE_CASES = [(q, ctx) for ctx in (8192, 32768) for q in (24, 256, 512, 1024)] + [(q, q) for q in (256, 512, 1024)]
# how items are cut: name -> (waves of programs, most slices an item); "split" is the backend's default
VARIANTS = {"whole": (1, 1), "split": (TritonAttentionBackend.SPLIT_WAVES, TritonAttentionBackend.MAX_PREFILL_SPLITS),
            "w4-s32": (4, 32), "w8-s64": (8, 64)}
# --tiles: split items under these tiles too (the default tile is r64-n64-w4-s3; r128-n128-w8-s3 is the
# tables' tile from 1024 prompt tokens)
TILES = [PrefillTile(rows=r, block_n=n, num_warps=w, num_stages=st)
         for r, n, w, st in ((16, 64, 4, 3), (64, 32, 4, 3), (64, 128, 4, 3), (64, 64, 4, 2), (64, 64, 4, 4),
                             (64, 64, 8, 3), (64, 128, 8, 2), (16, 128, 4, 4), (128, 128, 8, 3), (128, 64, 8, 3))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--tiles", action="store_true", help="chunks of 24-1024 tokens, the split items under other tiles")
    args = ap.parse_args()
    dev = torch.device("cuda")
    clock = Clock(dev, args.repeats)
    for q_len, ctx in TILE_CASES if args.tiles else CASES:
        q, kv, meta, kvs = paged([q_len], ctx, dev, torch.bfloat16, seed=q_len + ctx)
        ref = reference(q, *kvs[0])
        del kvs
        read = ctx * KV_HEADS * DIM * 2 * kv.element_size()
        layers = cold_caches(kv, read)
        us = {}
        runs = [(how, cut, None) for how, cut in VARIANTS.items() if how == "split" or not args.tiles]
        if args.tiles:
            runs += [(f"split {name(t)}", VARIANTS["split"], t) for t in TILES]
        pairs = q_len * (ctx - q_len) + q_len * (q_len + 1) // 2  # causal query-key pairs
        for how, (waves, most), tile in runs:
            backend = TritonAttentionBackend(HEADS, KV_HEADS, DIM, dev, prefill_tiles=only(tile) if tile else None)
            backend.SPLIT_WAVES, backend.MAX_PREFILL_SPLITS = waves, most
            backend.prepare(meta)
            err = rel_err(backend.attend(q, kv, meta, DIM ** -0.5), ref)
            if not err < TOL:
                wrong(f"{how} items, {q_len} tokens after {ctx - q_len}", err)
            us[how] = ms_per_layer(clock, backend, q, meta, layers) * 1e3
            emit(args.out, bench="split_prefill", q_len=q_len, context=ctx, items=how,
                 programs=int(meta.prefill_work.shape[0]) * KV_HEADS, us=round(us[how], 2),
                 kv_tb_per_s=round(read / us[how] / 1e6, 3), pct_of_bw=round(100 * read / us[how] / 1e-6 / PEAK_BW, 1),
                 tflops=round(4 * HEADS * DIM * pairs / us[how] / 1e6, 1),
                 rel_err=err)
        print(f"   {q_len:4d} tokens after {ctx - q_len:6d}: " + ", ".join(f"{k} {v:.1f}" for k, v in us.items())
              + f" us; floor {read / PEAK_BW * 1e6:.1f} us", flush=True)
        del layers, kv


if __name__ == "__main__":
    main()
