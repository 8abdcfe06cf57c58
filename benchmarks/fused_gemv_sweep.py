"""The fused decode layer's four GEMVs (layers/fused_gemv.py, issue #42) one by one, against
what they replace, with their tile shapes swept (Llama-3-8B shapes, bf16, random tensors):

    python benchmarks/fused_gemv_sweep.py [--rows 1,8] [--quick] [--out results.jsonl]

  qkv      RMSNorm folded in (norm_eps)            vs  add-and-RMSNorm kernel + cuBLAS
  o        + residual in the epilogue               vs  cuBLAS
  gate_up  RMSNorm folded in                        vs  add-and-RMSNorm kernel + cuBLAS
  down     SiLU-and-mul prologue + residual         vs  SiLU-and-mul kernel + cuBLAS

(the unfused layer adds the residual inside the next RMSNorm kernel: the kernels it runs).

Each timing replays a CUDA graph of one call per layer over 32 layers' own weights (they stream
from HBM, as in a decode step) and divides by the calls. One JSON line per (op, rows): the
replaced path (``unfused_us``), cuBLAS alone (``cublas_us``: the GEMV with no neighbours), the
fused op at its default tiles (``default_us``) and at the sweep's best (``best_us``, ``best``),
with the weight-read floor at the device-copy bandwidth measured here. The sweep runs at the
first of ``--rows``; its best is then timed at every row count.
"""

from __future__ import annotations

import argparse
import itertools
import math

import torch
import torch.nn.functional as F
from _shared import copy_bandwidth, emit, graph_us
from fused_layer_bench import GIB

from expresslane.layers import triton_ops
from expresslane.layers.fused_gemv import fused_gemv

HIDDEN, INTER, QKV = 4096, 14336, 6144
OPS = {"qkv": (QKV, HIDDEN), "o": (HIDDEN, HIDDEN), "gate_up": (2 * INTER, HIDDEN), "down": (HIDDEN, INTER)}
LAYERS = 32
EPS = 1e-5


def tiles(quick: bool) -> list[dict]:
    if quick:
        return [dict(block_n=n, block_k=k) for n, k in ((64, 128), (32, 256))]
    return [dict(block_n=n, block_k=k, warps=w, stages=s)
            for n, k, w, s in itertools.product((32, 64, 128), (128, 256), (4, 8), (3, 4)) if not (n == 32 and w == 8)]


def splits(n: int, k: int, cfg: dict) -> list[int]:
    """Split counts giving ~132..1056 programs (and 1) for this tile."""
    n_tiles = math.ceil(n / cfg["block_n"])
    steps = k // cfg["block_k"]
    return sorted({1} | {max(1, min(steps, 32, math.ceil(p / n_tiles))) for p in (132, 264, 528, 1056)})


class Op:
    """One op's 32 layers of weights and inputs at `m` rows."""

    def __init__(self, name: str, m: int):
        n, k = OPS[name]
        self.name, self.m, self.n, self.k = name, m, n, k
        self.ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(LAYERS)]
        width = 2 * k if name == "down" else k
        self.x = torch.randn(m, width, device="cuda", dtype=torch.bfloat16)
        self.res = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        self.g = torch.rand(k, device="cuda", dtype=torch.bfloat16) + 0.5

    def fused(self, w: torch.Tensor, cfg: dict):
        kw = dict(norm_eps=EPS) if self.name in ("qkv", "gate_up") else {}
        if self.name in ("o", "down"):
            kw["residual"] = self.res
        return lambda: fused_gemv(self.x, w, silu=self.name == "down", **kw, **cfg)

    def unfused(self, w: torch.Tensor):
        if self.name in ("qkv", "gate_up"):
            res = self.x.clone()
            return lambda: F.linear(triton_ops.rms_norm(self.x, self.g, EPS, res)[0], w)
        if self.name == "o":
            return lambda: F.linear(self.x, w)
        return lambda: F.linear(triton_ops.silu_and_mul(self.x), w)

    def cublas(self, w: torch.Tensor):
        x = self.x[:, :self.k].contiguous()
        return lambda: F.linear(x, w)

    def time(self, make, *args) -> float:
        try:
            return graph_us([make(w, *args) for w in self.ws])
        except Exception as e:  # a tile that needs more shared memory than there is
            print(f"{self.name} {args}: {str(e)[:120]}", flush=True)
            return math.inf


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8])
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--quick", action="store_true", help="two tiles only")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    bw = copy_bandwidth(GIB)
    for name in args.ops.split(","):
        n, k = OPS[name]
        floor_us = 2 * n * k / bw * 1e6
        best, best_us = {}, math.inf
        for m in args.rows:
            op = Op(name, m)
            if m == args.rows[0]:
                for cfg in tiles(args.quick):
                    for split in splits(n, k, cfg):
                        us = op.time(op.fused, dict(cfg, split=split))
                        if us < best_us:
                            best, best_us = dict(cfg, split=split), us
                        emit(args.out, bench="fused_gemv_sweep", op=name, m=m, cfg=dict(cfg, split=split),
                             us=round(us, 2))
            row = dict(bench="fused_gemv", op=name, m=m, n=n, k=k, floor_us=round(floor_us, 2),
                       unfused_us=round(op.time(op.unfused), 2), cublas_us=round(op.time(op.cublas), 2),
                       default_us=round(op.time(op.fused, {}), 2), best=best,
                       best_us=round(op.time(op.fused, best), 2))
            row["best_pct_of_floor"] = round(100 * floor_us / row["best_us"], 1)
            row["best_vs_unfused"] = round(row["unfused_us"] / row["best_us"], 3)
            emit(args.out, **row)
            del op
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
