"""The fused MoE path at decode sizes, one layer of a real shape (issue #17): where a layer's
time goes (router matmul, route, align, the two grouped GEMMs, the sum over slots: on one rank the
engine leaves it to the next fused RMSNorm, so it shows what that fold saves), the grouped
GEMMs' tiles swept, and cuBLAS on the same experts one linear at a time, each against the
routed weights' read floor.

    python benchmarks/moe_kernel_bench.py [--shapes qwen3-30b-a3b,mixtral-8x7b,gpt-oss-20b] [--tokens 1,4,16,64]
                                          [--sweep-tokens 1] [--tall-sweep-tokens 512] [--out results.jsonl]

gpt-oss-20b's experts are MXFP4 as shipped (random codes, scales 2^-9 .. 2^1), with its biases and
clamped SwiGLU: the kernel decodes them in the GEMM; their bytes are 17/32 of a byte a weight.

Every timing replays a CUDA graph of REPS calls, each with its own routing (random router
logits), so one call's experts are mostly not in L2 from the call before; µs per call.
GB/s: bytes of the experts a call routes to (gate and up for the first GEMM, down for the
second) over its time; the floor is those bytes at the H200's 4.27 TB/s. A swept tile's output
is checked against the default tiles' before it is reported.
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F
from _shared import emit, graph_us
from triton.runtime.errors import OutOfResources

from expresslane.bench.floors import H200_PEAK_BANDWIDTH as PEAK_BW
from expresslane.layers.moe import ClampedSwiGLU
from expresslane.quant.mxfp4 import Mxfp4Experts
from expresslane.layers import fused_moe
from expresslane.layers.fused_moe import (
    Tiles,
    _tiles,
    align_by_expert,
    fused_experts,
    fused_route,
    grouped_gemm,
)

SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768), "mixtral-8x7b": (8, 2, 4096, 14336),  # experts, top-k, H, I
          "gpt-oss-20b": (32, 4, 2880, 2880)}
MXFP4 = {"gpt-oss-20b"}  # shapes whose experts are MXFP4 (with biases and the clamped SwiGLU)
REPS = 16


def calls_us(fn) -> float:
    """µs per call of fn(r), r = 0..REPS-1, captured once in a CUDA graph and replayed."""
    return graph_us([lambda r=r: fn(r) for r in range(REPS)])


def bench_shape(name: str, tokens_list: list[int], sweep_tokens: set[int], tall_tokens: set[int], out) -> None:
    experts, _, hidden, inter = SHAPES[name]
    dev, dt = torch.device("cuda"), torch.bfloat16
    if name in MXFP4:
        w13, w2 = Mxfp4Experts(experts, 2 * inter, hidden).to(dev), Mxfp4Experts(experts, hidden, inter).to(dev)
        for w in (w13, w2):
            w.blocks.data.random_(0, 256)
            w.scales.data.random_(118, 129)
    else:
        w13 = torch.empty(experts, 2 * inter, hidden, dtype=dt, device=dev).normal_(std=hidden ** -0.5)
        w2 = torch.empty(experts, hidden, inter, dtype=dt, device=dev).normal_(std=inter ** -0.5)
    gate = torch.empty(experts, hidden, dtype=dt, device=dev).normal_(std=hidden ** -0.5)
    for tokens in tokens_list:
        bench_tokens(name, tokens, (w13, w2, gate), tokens in sweep_tokens, tokens in tall_tokens, out)


def bench_tokens(name: str, tokens: int, weights: tuple, tiles_swept: bool, tall_swept: bool, out) -> None:
    """One layer's pieces for `tokens` tokens (and its GEMMs' tiles swept when `tiles_swept`, tall
    ones when `tall_swept`)."""
    experts, k, hidden, inter = SHAPES[name]
    w13, w2, gate = weights
    dev, dt = gate.device, gate.dtype
    x = torch.randn(tokens, hidden, dtype=dt, device=dev)
    logits = [torch.randn(tokens, experts, dtype=dt, device=dev) * 2 for _ in range(REPS)]
    counts = torch.zeros(experts, dtype=torch.int64, device=dev)
    slots = torch.arange(tokens, device=dev)
    routed = [fused_route(lg, k, True, counts, slots) for lg in logits]  # (weights, ids) per call
    used = sum(len(ids.unique()) for _, ids in routed) / REPS  # experts a call reads
    per_weight = 17 / 32 if name in MXFP4 else 2  # bytes: MXFP4 codes and a scale a 32, or bf16
    bytes1, bytes2 = used * 2 * inter * hidden * per_weight, used * hidden * inter * per_weight
    b13, b2, swiglu = (None, None, None)
    if name in MXFP4:
        b13 = torch.randn(experts, 2 * inter, dtype=dt, device=dev) * 0.1
        b2 = torch.randn(experts, hidden, dtype=dt, device=dev) * 0.1
        swiglu = ClampedSwiGLU(limit=7.0)
    n = tokens * k
    tiles1, tiles2 = _tiles(n, experts, hidden), _tiles(n, experts, inter)
    aligned = {m: [align_by_expert(ids, experts, m) for _, ids in routed]  # by the tiles' rows
               for m in {tiles1.block_m, 1 if name in MXFP4 else tiles1.block_m}}
    act = torch.empty(n, inter, dtype=dt, device=dev)
    rows_out = torch.empty(n, hidden, dtype=dt, device=dev)

    def gemm1(r, t=tiles1, by_expert=None):  # by_expert: an alignment made for t.block_m (else the table's)
        grouped_gemm(x, w13, act, routed[r][0], by_expert or aligned[t.block_m][r], k, True, t, b13, swiglu)

    def gemm2(r, t=tiles2, by_expert=None):
        grouped_gemm(act, w2, rows_out, routed[r][0], by_expert or aligned[t.block_m][r], k, False, t, b2)

    pieces = {
        "router_matmul": lambda r: F.linear(x, gate),
        **{f"route_warps{w}": (lambda r, w=w: fused_route(logits[r], k, True, counts, slots, warps=w))
           for w in (1, 2, 4)},
        "align": lambda r: align_by_expert(routed[r][1], experts, tiles1.block_m),
        "gemm1": gemm1, "gemm2": gemm2,
        "sum": lambda r: rows_out.view(tokens, k, hidden).sum(1),
        "experts_whole": lambda r: fused_experts(x, w13, w2, routed[r][0], routed[r][1], all_routed=True, b13=b13,
                                                 b2=b2, act=swiglu),
    }
    if name in MXFP4 and hasattr(fused_moe, "dequantize_experts"):  # each path of MXFP4 experts, forced
        def forced(r, **settings):  # module settings, read when the graph is captured
            kept = {key: getattr(fused_moe, key) for key in settings}
            try:
                for key, value in settings.items():
                    setattr(fused_moe, key, value)
                pieces["experts_whole"](r)
            finally:
                for key, value in kept.items():
                    setattr(fused_moe, key, value)
        pieces.update(decode_whole_w13=lambda r: fused_moe.dequantize_experts(w13, dt),
                      decode_whole_w2=lambda r: fused_moe.dequantize_experts(w2, dt),
                      experts_in_kernel=lambda r: forced(r, MX4_IN_KERNEL_ROWS=1 << 30),
                      experts_decoded_whole=lambda r: forced(r, MX4_IN_KERNEL_ROWS=-1, MX4_DOT=False))
        if hasattr(fused_moe, "MX4_TILES"):
            one_row = (Tiles(1, 32, 128, 4), Tiles(1, 32, 128, 4))
            pieces["experts_one_row_tiles"] = lambda r: forced(r, MX4_IN_KERNEL_ROWS=1 << 30, MX4_TILES=one_row)
        if hasattr(fused_moe, "MX4_DOT"):  # the tensor-core tiles' product: Triton's scaled dot, or the kernel's own
            for dot in (True, False):
                pieces[f"experts_scaled_dot_{dot}"] = lambda r, d=dot: forced(r, MX4_IN_KERNEL_ROWS=1 << 30,
                                                                              MX4_TILES=None, MX4_DOT=d)
    us = {p: round(calls_us(fn), 2) for p, fn in pieces.items()}
    row = {"bench": "moe_kernels", "shape": name, "tokens": tokens, "experts_read": used,
           "tiles": [list(tiles1), list(tiles2)], "us": us, "gemm1_gb_s": round(bytes1 / us["gemm1"] / 1e3),
           "gemm2_gb_s": round(bytes2 / us["gemm2"] / 1e3), "floor_us": round((bytes1 + bytes2) / PEAK_BW * 1e6, 2),
           "gemms_tflop_s": round(2 * n * 3 * inter * hidden / (us["gemm1"] + us["gemm2"]) / 1e6, 1)}
    if tokens == 1 and name not in MXFP4:  # the library alternative: each routed expert as two cuBLAS linears
        chosen = [ids[0].tolist() for _, ids in routed]  # read before the capture

        def cublas(r):
            for e in chosen[r]:
                h = F.linear(x, w13[e])
                F.linear(h[:, :inter], w2[e])
        row["cublas_linears_us"] = round(calls_us(cublas), 2)
    emit(out, **row)
    if tiles_swept:
        sweep(name, tokens, gemm1, gemm2, tiles1, tiles2, act, rows_out, bytes1, bytes2, out, name in MXFP4)
    if tall_swept and name in MXFP4:
        sweep_tall(name, tokens, routed, experts, gemm1, gemm2, tiles1, tiles2, act, rows_out, out)


def time_tiles(candidates: list, result: torch.Tensor, run) -> list:
    """(µs, tiles, dot, matches) of run(r, tiles) under MX4_DOT = dot for each (tiles, dot) of
    `candidates`, fastest first; each one's output (`result`) checked against the first's (the
    default); a tile out of shared memory: inf."""
    kept = getattr(fused_moe, "MX4_DOT", False)
    timed, reference = [], None
    for t, dot in dict.fromkeys(candidates):
        try:
            fused_moe.MX4_DOT = dot  # read at the launches the graph captures
            result.zero_()
            run(0, t)
            reference = result.clone() if reference is None else reference
            ok = torch.allclose(result.float(), reference.float(), atol=2e-2, rtol=2e-2)
            timed.append((calls_us(lambda r, t=t: run(r, t)), t, dot, ok))
        except OutOfResources as e:
            timed.append((float("inf"), t, dot, repr(e)[:80]))
        finally:
            fused_moe.MX4_DOT = kept
    return sorted(timed, key=lambda x: x[0])


def sweep(name, tokens, gemm1, gemm2, tiles1, tiles2, act, rows_out, bytes1, bytes2, out, mx4: bool) -> None:
    """Each GEMM under every tile of a grid (block_m kept: the alignment's; `mx4`, MXFP4: tiles of one
    row too, multiplying without tensor cores, and the tensor-core tiles with and without MX4_DOT's
    scaled dot); the eight fastest, `dot` the MX4_DOT of each."""
    for label, fn, default, result, nbytes in (("gemm1", gemm1, tiles1, act, bytes1),
                                               ("gemm2", gemm2, tiles2, rows_out, bytes2)):
        grid = [(Tiles(m, bn, bk, warps, stages), dot)
                for m in ((default.block_m, 1) if mx4 else (default.block_m,))
                for bn, bk, warps, stages in itertools.product((16, 32, 64), (128, 256), (2, 4),
                                                               (3,) if mx4 else (3, 5))
                for dot in ((False, True) if mx4 and m > 1 else (False,))]
        kept = getattr(fused_moe, "MX4_DOT", False)
        timed = time_tiles([(default, kept), *grid], result, lambda r, t, fn=fn: fn(r, t))
        default_us = next(u for u, t, dot, _ in timed if t == default and dot == kept)
        emit(out, bench="moe_tile_sweep", shape=name, tokens=tokens, gemm=label, default=list(default),
             default_us=round(default_us, 2), default_gb_s=round(nbytes / default_us / 1e3),
             best=[dict(tiles=list(t), dot=dot, us=round(u, 2), gb_s=round(nbytes / u / 1e3), matches=ok)
                   for u, t, dot, ok in timed[:8]])


def sweep_tall(name, tokens, routed, experts, gemm1, gemm2, tiles1, tiles2, act, rows_out, out) -> None:
    """MXFP4 experts at prefill sizes: each GEMM decoded in the kernel under tiles of 16-128 rows
    (each block_m with its own alignment), Triton's scaled dot against the kernel's own decode,
    the fastest eight against the default tiles (whose time, in the kernel, `moe_kernels` gives as
    experts_in_kernel; decoded whole: experts_decoded_whole)."""
    flops = 2 * tokens * SHAPES[name][1] * 3 * SHAPES[name][2] * SHAPES[name][3]
    for label, fn, default, result, share in (("gemm1", gemm1, tiles1, act, 2 / 3), ("gemm2", gemm2, tiles2, rows_out,
                                                                                      1 / 3)):
        grid = [(Tiles(m, bn, bk, warps, stages), dot)
                for m, bn, bk, warps, stages in itertools.product((16, 32, 64, 128), (64, 128), (128, 256), (4, 8),
                                                                  (3,))
                for dot in (True, False)]
        kept = fused_moe.MX4_DOT
        aligned = {m: [align_by_expert(ids, experts, m) for _, ids in routed] for m in (16, 32, 64, 128)}
        timed = time_tiles([(default, kept), *grid], result,
                           lambda r, t, fn=fn: fn(r, t, aligned[t.block_m][r]))
        default_us = next(u for u, t, dot, _ in timed if t == default and dot == kept)
        emit(out, bench="moe_tall_sweep", shape=name, tokens=tokens, gemm=label, default=list(default),
             default_us=round(default_us, 2), default_tflop_s=round(flops * share / default_us / 1e6, 1),
             best=[dict(tiles=list(t), dot=dot, us=round(u, 2), tflop_s=round(flops * share / u / 1e6, 1),
                        matches=ok) for u, t, dot, ok in timed[:8]])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="qwen3-30b-a3b,mixtral-8x7b")
    ap.add_argument("--tokens", default="1,4,16,64")
    ap.add_argument("--sweep-tokens", default="1")
    ap.add_argument("--tall-sweep-tokens", default="", help="MXFP4 shapes: token counts whose GEMMs sweep tiles of "
                    "16-128 rows (prefill)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    for name in args.shapes.split(","):
        bench_shape(name, [int(t) for t in args.tokens.split(",")],
                    {int(t) for t in args.sweep_tokens.split(",") if t},
                    {int(t) for t in args.tall_sweep_tokens.split(",") if t}, args.out)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
