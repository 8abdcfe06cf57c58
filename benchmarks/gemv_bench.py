"""Decode GEMVs and quantized linear layers per kernel and Llama-3-8B shape, on random tensors:
achieved TB/s of weight reads against the H200's bandwidth, beside the bf16 cuBLAS alternative.

    python benchmarks/gemv_bench.py [--out results.jsonl] [--sweep] [--rows 1,2,4,8,16]

Each timing replays a CUDA graph of one call per layer over 32 layers' own weights (so the
weights stream from HBM, not the 60 MB L2, as in a decode step; fewer layers for long inputs)
and divides by the calls: kernel time plus the gaps between graph nodes. One JSON line per
(kernel, shape, rows[, config]): us per call, weight TB/s, % of the copy bandwidth, and the
bf16 cuBLAS call's time on the same shape. Then the whole decode step's linear layers (32
layers x qkv, o, gate_up, down) per format, and the INT4 paths for prompts (tile kernel vs
dequantize + cuBLAS). ``--sweep`` also times tile shapes and splits (the defaults in
quant/gemv.py come from it).

The FP8 fold (layers/triton_ops.py: the fused RMSNorm and SiLU-and-mul quantize their output
for an FP8 consumer): ``gemv_fold_check`` checks the e4m3 bytes and scales against
``per_token_quant_fp8`` in bf16, ``gemv_fold`` times each producer folded against producer +
quantization, and ``gemv_decode_step`` ``impl=gemv_fold`` the step's FP8 linears fed quantized
inputs (o_proj still quantizing its own).
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
from _shared import emit, graph_us

from expresslane.bench.floors import H200_PEAK_BANDWIDTH as PEAK_BW

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}  # (N, K)
LAYERS = 32
GROUP = 128


class Weights:
    """Random weights of every layer and shape, per format (made on first use)."""

    def __init__(self):
        self.cache = {}

    def get(self, fmt: str, shape: str) -> list:
        key = (fmt, shape)
        if key not in self.cache:
            n, k = SHAPES[shape]
            gen = {"bf16": self._bf16, "fp8": self._fp8, "int4": self._int4}[fmt]
            self.cache[key] = [gen(n, k) for _ in range(LAYERS)]
        return self.cache[key]

    @staticmethod
    def _bf16(n, k):
        return (torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02,)

    @staticmethod
    def _fp8(n, k):
        w = (torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 32).to(torch.float8_e4m3fn)
        return w, torch.rand(n, device="cuda") * 1e-3 + 1e-4

    @staticmethod
    def _int4(n, k):
        qw = torch.randint(-2**31, 2**31, (k // 8, n), device="cuda", dtype=torch.int64).to(torch.int32)
        scales = (torch.rand(k // GROUP, n, device="cuda") * 1e-2).half()
        zeros = torch.randint(0, 16, (k // GROUP, n), device="cuda", dtype=torch.uint8)
        return qw, scales, zeros


def weight_bytes(fmt: str, n: int, k: int) -> float:
    return {"bf16": 2 * n * k, "fp8": n * k + 4 * n, "int4": n * k / 2 + 3 * n * k / GROUP}[fmt]


def op(fmt: str, impl: str, x: torch.Tensor, w: tuple, cfg: dict):
    """One call of `impl` on weights `w` (a closure for graph capture)."""
    from expresslane.quant.gemv import gemv, int4_gemv
    from expresslane.quant.kernels import int4_dequantize, per_token_quant_fp8, quant_gemm

    if impl == "cublas":
        return lambda: F.linear(x, w[0])
    if impl == "gemv" and fmt == "bf16":
        return lambda: gemv(x, w[0], None, None, **cfg)
    if impl == "gemv" and fmt == "fp8":
        return lambda: gemv(x, w[0], w[1], None, **cfg)
    if impl == "gemv_fold":  # x arrives quantized by its producer (the FP8 fold)
        xq = per_token_quant_fp8(x)
        return lambda: gemv(x, w[0], w[1], None, xq=xq, **cfg)
    if impl == "scaled_mm":  # the prefill path: quantize, then cuBLAS FP8
        def run():
            xq, xs = per_token_quant_fp8(x)
            return torch._scaled_mm(xq, w[0].t(), scale_a=xs, scale_b=w[1][None, :], out_dtype=torch.bfloat16)
        return run
    if impl == "gemv" and fmt == "int4":
        return lambda: int4_gemv(x, w[0], w[1], w[2], None, GROUP, **cfg)
    if impl == "tile":
        return lambda: quant_gemm(x, w[0], w[1], w[2], None, w[0].shape[1], GROUP)
    if impl == "dequant_cublas":
        return lambda: x @ int4_dequantize(w[0], w[1], w[2], GROUP, x.dtype)
    raise ValueError(impl)


def measure(ws: Weights, out, fmt: str, impl: str, shape: str, m: int, cfg: dict | None = None,
            layers: int = LAYERS, reps: int = 10, cublas_us: float | None = None, quiet: bool = False):
    n, k = SHAPES[shape]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    calls = [op(fmt, impl, x, w, cfg or {}) for w in ws.get(fmt, shape)[:layers]]
    try:
        us = graph_us(calls, reps)
    except Exception as e:  # e.g. a tile shape that needs more shared memory than there is
        emit(out, bench="gemv", fmt=fmt, impl=impl, shape=shape, m=m, cfg=str(cfg), error=str(e)[:200])
        return math.inf
    tbs = weight_bytes(fmt, n, k) / us / 1e6
    row = dict(bench="gemv", fmt=fmt, impl=impl, shape=shape, n=n, k=k, m=m, us=round(us, 2),
               weight_tb_per_s=round(tbs, 3), pct_of_bw=round(100 * tbs * 1e12 / PEAK_BW, 1))
    if cfg:
        row["cfg"] = cfg
    if cublas_us:
        row.update(cublas_bf16_us=round(cublas_us, 2), speedup_vs_cublas_bf16=round(cublas_us / us, 2))
    if not quiet:
        emit(out, **row)
    return us


def check(out) -> None:
    """Each GEMV on the GPU against float32 on its own inputs (bf16 activations), 8B shapes."""
    from expresslane.quant.fp8 import fp8_linear_reference, quantize_per_row
    from expresslane.quant.gemv import gemv, int4_gemv
    from expresslane.quant.int4 import dequantize, pack_rows, quantize_groups

    for shape, (n, k) in SHAPES.items():
        for m in (1, 3, 16):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(n, k, device="cuda") * 0.02
            wq, wsc = quantize_per_row(w)
            rows = {"fp8": (gemv(x, wq, wsc, None).float(), fp8_linear_reference(x.float(), wq, wsc, None))}
            if m <= 4:
                q, z, s = quantize_groups(w, GROUP, sym=False)
                qw, zz, ss = pack_rows(q), z.to(torch.uint8), s.half()
                wf = dequantize(qw, zz, ss, GROUP)
                rows["int4"] = (int4_gemv(x, qw, ss, zz, None, GROUP).float(), x.float() @ wf)
            wb = w.to(torch.bfloat16)
            rows["bf16"] = (gemv(x, wb, None, None).float(), x.float() @ wb.float().t())
            for fmt, (got, want) in rows.items():
                rel = ((got - want).abs().max() / want.abs().max()).item()
                emit(out, bench="gemv_check", fmt=fmt, shape=shape, m=m, max_rel_err=rel, ok=rel < 2**-7)


SWEEP = {  # (fmt, impl): configs at one row; each with splits for ~132..2112 programs
    ("fp8", "gemv"): [dict(block_n=64, block_k=256, stages=4), dict(block_n=64, block_k=128, stages=6),
                      dict(block_n=128, block_k=256, stages=4), dict(block_n=128, block_k=128, stages=4)],
    ("bf16", "gemv"): [dict(block_n=64, block_k=128, stages=4), dict(block_n=128, block_k=128, stages=3)],
    ("int4", "gemv"): [dict(block_n=256, warps=2, rows=8, stages=1), dict(block_n=256, warps=2, rows=8, stages=2),
                       dict(block_n=256, warps=2, rows=4, stages=1), dict(block_n=128, warps=1, rows=8, stages=1)],
}


def sweep(ws: Weights, out) -> dict:
    """Tile shapes and splits at one row, per shape; returns the fastest config per (fmt, impl, shape)."""
    best = {}
    for (fmt, impl), configs in SWEEP.items():
        for shape, (n, k) in SHAPES.items():
            top = (math.inf, None)
            steps = k // (8 * 8) if fmt == "int4" else k // 128
            for base in configs:
                tiles = math.ceil(n / base["block_n"])
                for split in sorted({max(1, min(steps, math.ceil(p / tiles))) for p in (132, 264, 528, 1056, 2112)}):
                    cfg = dict(base, split=split)
                    us = measure(ws, out, fmt, impl, shape, 1, cfg, quiet=True)
                    if us < top[0]:
                        top = (us, cfg)
            best[fmt, impl, shape] = top[1]
            emit(out, bench="gemv_sweep_best", fmt=fmt, impl=impl, shape=shape, us=round(top[0], 2), cfg=top[1],
                 weight_tb_per_s=round(weight_bytes(fmt, n, k) / top[0] / 1e6, 3))
    return best


def decode_step(ws: Weights, out, fmt: str, impl: str, cfgs: dict | None = None, label: str = "default") -> None:
    """The linear layers of one batch-1 decode step (32 layers x qkv, o, gate_up, down), in order.
    ``gemv_fold``: FP8 with every input but o_proj's quantized by its producer."""
    x = {k: torch.randn(1, k, device="cuda", dtype=torch.bfloat16) for k in {k for _, k in SHAPES.values()}}
    calls = [op(fmt, "gemv" if impl == "gemv_fold" and s == "o" else impl, x[SHAPES[s][1]], ws.get(fmt, s)[i],
                (cfgs or {}).get(s, {}))
             for i in range(LAYERS) for s in SHAPES]
    us = graph_us(calls, reps=10) * len(calls)
    total = sum(weight_bytes(fmt, *SHAPES[s]) for s in SHAPES) * LAYERS
    emit(out, bench="gemv_decode_step", fmt=fmt, impl=impl, configs=label, layers=LAYERS, ms=round(us / 1e3, 3),
         weight_gb=round(total / 1e9, 2), weight_tb_per_s=round(total / us / 1e6, 3),
         pct_of_bw=round(100 * total / us / 1e-6 / PEAK_BW, 1))


def fold(out) -> None:
    """The FP8 fold at the 8B shapes: the fused producers' e4m3 rows and scales against
    per_token_quant_fp8 of the rows they store (bf16: must be equal), and their time per call
    folded against producer + per_token_quant_fp8 (one row, and the 16-row GEMV limit)."""
    from expresslane.layers import triton_ops
    from expresslane.quant.kernels import per_token_quant_fp8

    hidden, inter = SHAPES["o"][0], SHAPES["down"][1]
    for m in (1, 16):
        x = torch.randn(m, hidden, device="cuda", dtype=torch.bfloat16)
        res = torch.randn(m, hidden, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(hidden, device="cuda", dtype=torch.bfloat16)
        gate_up = torch.randn(m, 2 * inter, device="cuda", dtype=torch.bfloat16) * 4
        producers = {"rms_norm_residual": (lambda fp8: triton_ops.rms_norm(x, w, 1e-5, res, fp8_out=fp8)[0]),
                     "silu_and_mul": (lambda fp8: triton_ops.silu_and_mul(gate_up, fp8_out=fp8))}
        for name, run in producers.items():
            got = run(True)
            q, s = per_token_quant_fp8(got.x)
            exact = torch.equal(got.q.view(torch.uint8), q.view(torch.uint8)) and torch.equal(got.scale, s)
            emit(out, bench="gemv_fold_check", op=name, m=m, exact=exact)
            folded = graph_us([lambda run=run: run(True)] * 32)
            separate = graph_us([lambda run=run: per_token_quant_fp8(run(False))] * 32)
            alone = graph_us([lambda run=run: run(False)] * 32)
            emit(out, bench="gemv_fold", op=name, m=m, folded_us=round(folded, 2), separate_us=round(separate, 2),
                 producer_alone_us=round(alone, 2), saved_us=round(separate - folded, 2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--sweep", action="store_true", help="also time tile shapes and splits")
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--prompt-rows", default="16,64,128,512,2048,8192", help="INT4 long-input paths")
    args = ap.parse_args()
    torch.manual_seed(0)
    out = args.out
    check(out)
    fold(out)
    from expresslane.quant import fp8 as fp8_mod
    from expresslane.quant import int4 as int4_mod
    from expresslane.quant.kernels import per_token_quant_fp8

    ws = Weights()
    for k in (4096, 14336):  # the FP8 path's activation quantization alone (part of every FP8 call)
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        emit(out, bench="gemv_quant_x", k=k, m=1, us=round(graph_us([lambda: per_token_quant_fp8(x)] * 32), 2))
    best = sweep(ws, out) if args.sweep else {}
    rows = [int(r) for r in args.rows.split(",")]
    for shape in SHAPES:
        for m in rows:
            base = measure(ws, out, "bf16", "cublas", shape, m)
            measure(ws, out, "bf16", "gemv", shape, m, cublas_us=base)
            measure(ws, out, "fp8", "gemv", shape, m, cublas_us=base)
            if m == 16:
                measure(ws, out, "fp8", "scaled_mm", shape, m, cublas_us=base)
            if m <= 8:
                measure(ws, out, "int4", "gemv", shape, m, cublas_us=base)
            if m >= 4:
                measure(ws, out, "int4", "tile", shape, m, cublas_us=base)
    for fmt, impl in (("bf16", "cublas"), ("bf16", "gemv"), ("fp8", "gemv"), ("fp8", "gemv_fold"), ("int4", "gemv")):
        decode_step(ws, out, fmt, impl)
        if (fmt, impl, "o") in best:
            decode_step(ws, out, fmt, impl, {s: best[fmt, impl, s] for s in SHAPES}, "sweep-best")
    # INT4 for prompts: the tile kernel against dequantize + cuBLAS, beside bf16 cuBLAS
    for m in [int(r) for r in args.prompt_rows.split(",") if r]:
        layers, reps = (8, 5) if m <= 512 else (2, 3)
        for shape in SHAPES:
            base = measure(ws, out, "bf16", "cublas", shape, m, layers=layers, reps=reps)
            for impl in ("tile", "dequant_cublas"):
                measure(ws, out, "int4", impl, shape, m, layers=layers, reps=reps, cublas_us=base)
    emit(out, bench="gemv_thresholds", fp8_gemv_m=fp8_mod.SMALL_M, int4_gemv_m=int4_mod.GEMV_M,
         int4_tile_n=int4_mod.TILE_N, int4_tile_m=int4_mod.TILE_M)


if __name__ == "__main__":
    main()
