"""Decode attention over a bf16 vs an FP8 KV cache (the Triton kernels), one layer of the
Llama-3-8B shape (32 query heads, 8 KV heads, head dim 128, pages of 16) at batch 64 and
8k context: us per call (split kernel + reduction, timed in CUDA graphs by attention_bench's
`Clock`) and the KV bytes read per second, for the tile the table picks and a sweep of
decode tiles.

Why the sweep: with the bf16 tile the FP8 cache, which reads half the bytes, is slower than
bf16 (its 8-bit operands are read from shared memory a byte at a time, `LDS.U8`); the sweep
shows which tile pays (the FP8 table's from batch 32, triton_tiles.FP8_DECODE_TILES; the runs:
docs/performance.md, "Quantization"). Every tile's output is checked against the table
tile's (same cache) before it is timed.

    python benchmarks/kv_attention_bench.py [--out results.jsonl] [--batch 64] [--context 8144]
    TRITON_INTERPRET=1 python benchmarks/kv_attention_bench.py --smoke   # tiny shapes on CPU
"""

from __future__ import annotations

import argparse
import sys

import torch
from _shared import emit
from attention_bench import DIM, HEADS, KV_HEADS, PAGE, TOL, Clock, name, only, rel_err

from expresslane.attention.backend import AttentionMetadata
from expresslane.attention.triton_backend import TritonAttentionBackend
from expresslane.attention.triton_tiles import DECODE_TILES, FP8_DECODE_TILES, DecodeTile, pick
from expresslane.bench.floors import H200_PEAK_BANDWIDTH as PEAK_BW


def tiles(batch: int, smoke: bool, fp8: bool) -> list[DecodeTile]:
    """The table's tile (of this cache's dtype) first, then key tiles x pipeline stages, at the
    table's splits and at up to 64 splits over 4 waves (2 splits at batch 64 on an H200: the bf16
    winner of `attention_bench`)."""
    table = pick(FP8_DECODE_TILES if fp8 else DECODE_TILES, DIM, batch, DecodeTile())
    if smoke:
        return [table, DecodeTile(num_stages=1, block_n=16)]
    shapes = [dict(block_n=32), dict(block_n=64), dict(block_n=128, num_warps=8)]
    sweep = [DecodeTile(max_splits=ms, waves=w, num_stages=st, **shape)
             for ms, w in ((table.max_splits, table.waves), (64, 4)) for st in (1, 2, 3) for shape in shapes]
    return list(dict.fromkeys([table] + sweep))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=8144)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, two tiles, on CPU with TRITON_INTERPRET=1")
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type != "cuda" and not args.smoke:
        ap.error("needs a CUDA device (or --smoke on CPU with TRITON_INTERPRET=1)")
    b, ctx = (2, 40) if args.smoke else (args.batch, args.context)
    per_seq = -(-ctx // PAGE)
    blocks = torch.randperm(b * per_seq, device=dev, dtype=torch.int32).view(b, per_seq)  # scattered pages
    lens = [ctx] * b
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(b, dtype=torch.int64, device=dev), block_tables=blocks,
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
        query_start_loc=torch.arange(b + 1, dtype=torch.int32, device=dev), num_decodes=b, seq_lens_cpu=lens,
        query_start_loc_cpu=list(range(b + 1)), max_decode_seq_len=ctx)
    q = torch.randn(b, HEADS, DIM, device=dev, dtype=torch.bfloat16)
    clock = Clock(dev, repeats=5)
    measured: dict[str, list[dict]] = {}
    wrong = []
    for kv_name, dtype, scales in (("bf16", torch.bfloat16, (1.0, 1.0)), ("fp8", torch.float8_e4m3fn, (0.05, 0.05))):
        kv = torch.randn(2, b * per_seq, PAGE, KV_HEADS, DIM, device=dev, dtype=torch.bfloat16).to(dtype)
        read = b * ctx * KV_HEADS * DIM * 2 * kv.element_size()
        ref, rows = None, measured.setdefault(kv_name, [])
        for i, tile in enumerate(tiles(b, args.smoke, dtype.itemsize == 1)):
            backend = TritonAttentionBackend(HEADS, KV_HEADS, DIM, dev, decode_tiles=only(tile))
            backend.prepare(meta)
            call = lambda backend=backend: backend.attend(q, kv, meta, DIM ** -0.5, scales)  # noqa: E731
            got = call()
            if ref is None:
                ref, err = got, 0.0
            else:
                err = rel_err(got, ref)
                if not err < TOL:
                    wrong.append(f"{kv_name} {name(tile)}: rel err {err:.1e} against the table tile")
                    continue
            us = clock(call, graph=True) * 1e3
            rows.append(dict(bench="kv_decode_attention", kv_dtype=kv_name, batch=b, context=ctx, tile=name(tile),
                             in_table=i == 0, splits=meta.num_splits, us=round(us, 1), kv_gb=round(read / 1e9, 3),
                             kv_tb_per_s=round(read / us / 1e6, 3),
                             pct_of_bw=round(100 * read / us / 1e-6 / PEAK_BW, 1), rel_err_vs_table=round(err, 5)))
            emit(args.out, **rows[-1])
        del kv
    table = {k: rows[0] for k, rows in measured.items()}
    best = {k: min(rows, key=lambda r: r["us"]) for k, rows in measured.items()}
    for k in measured:
        emit(args.out, bench="kv_decode_attention_best", kv_dtype=k, tile=best[k]["tile"], us=best[k]["us"],
             table_tile=table[k]["tile"], table_us=table[k]["us"], kv_tb_per_s=best[k]["kv_tb_per_s"],
             pct_of_bw=best[k]["pct_of_bw"])
    emit(args.out, bench="kv_decode_attention_ratio", fp8_over_bf16_table=round(table["fp8"]["us"] / table["bf16"]["us"], 3),
         fp8_over_bf16_best=round(best["fp8"]["us"] / best["bf16"]["us"], 3))
    if wrong:
        sys.exit("tiles that disagree with the table tile: " + "; ".join(wrong))


if __name__ == "__main__":
    main()
