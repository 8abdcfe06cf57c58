"""Decode attention over a bf16 vs an FP8 KV cache (the Triton kernels), one layer of the
Llama-3-8B shape (32 query heads, 8 KV heads, head dim 128, pages of 16) at batch 64 and
8k context: us per call (split kernel + reduction, from a CUDA graph of 10 calls) and the
KV bytes read per second.

    python benchmarks/kv_attention_bench.py [--out results.jsonl] [--batch 64] [--context 8144]
"""

from __future__ import annotations

import argparse

import torch
from _shared import emit

from expresslane.attention.backend import AttentionMetadata
from expresslane.attention.triton_backend import TritonAttentionBackend
from expresslane.bench.floors import H200_PEAK_BANDWIDTH as PEAK_BW

HEADS, KV_HEADS, DIM, PAGE = 32, 8, 128, 16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=8144)
    args = ap.parse_args()
    b, ctx, dev = args.batch, args.context, torch.device("cuda")
    per_seq = -(-ctx // PAGE)
    blocks = torch.randperm(b * per_seq, device=dev, dtype=torch.int32).view(b, per_seq)  # scattered pages
    lens = [ctx] * b
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(b, dtype=torch.int64, device=dev), block_tables=blocks,
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
        query_start_loc=torch.arange(b + 1, dtype=torch.int32, device=dev), num_decodes=b, seq_lens_cpu=lens,
        query_start_loc_cpu=list(range(b + 1)), max_decode_seq_len=ctx)
    backend = TritonAttentionBackend(HEADS, KV_HEADS, DIM, dev)
    backend.prepare(meta)
    q = torch.randn(b, HEADS, DIM, device=dev, dtype=torch.bfloat16)
    times = {}
    for name, dtype, scales in (("bf16", torch.bfloat16, (1.0, 1.0)), ("fp8", torch.float8_e4m3fn, (0.05, 0.05))):
        kv = torch.randn(2, b * per_seq, PAGE, KV_HEADS, DIM, device=dev, dtype=torch.bfloat16).to(dtype)
        call = lambda: backend.attend(q, kv, meta, DIM ** -0.5, scales)  # noqa: E731
        call()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(10):
                call()
        g.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            g.replay()
        end.record()
        torch.cuda.synchronize()
        us = start.elapsed_time(end) * 1e3 / 50
        read = b * ctx * KV_HEADS * DIM * 2 * kv.element_size()
        times[name] = us
        emit(args.out, bench="kv_decode_attention", kv_dtype=name, batch=b, context=ctx, splits=meta.num_splits,
             us=round(us, 1), kv_gb=round(read / 1e9, 3), kv_tb_per_s=round(read / us / 1e6, 3),
             pct_of_bw=round(100 * read / us / 1e-6 / PEAK_BW, 1))
    emit(args.out, bench="kv_decode_attention_ratio", fp8_over_bf16=round(times["fp8"] / times["bf16"], 3))


if __name__ == "__main__":
    main()
