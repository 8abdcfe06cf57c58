"""Issue #41 probes on the GPU, each printed as one JSON line:

- copy_engine: does a LoRA slot load (a large pinned host-to-device copy on a side stream)
  hold up a step's own small input copy on the main stream? Small copy latency alone, beside
  one big copy, and beside the same bytes cut into pieces.
- projections: one decode step's projections at batch 1 (Llama-3-8B shapes, 32 layers x
  qkv / o / gate|up / down, distinct weights so L2 holds none), captured in a CUDA graph,
  per variant: the base model (cuBLAS, or the split-K Triton GEMV) and the LoRA paths.

    python benchmarks/lora_probe.py [--out results.jsonl]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _shared import emit  # noqa: E402

from expresslane.device import arrival_counters  # noqa: E402
from expresslane.layers.lora import LoRAStep  # noqa: E402
from expresslane.layers.lora_kernels import lora_expand, lora_shrink, shrink_output  # noqa: E402
from expresslane.layers.lora_kernels import BLOCK_K as SHRINK_BLOCK_K  # noqa: E402
from expresslane.layers.lora_kernels import BLOCK_M as SHRINK_BLOCK_M  # noqa: E402
from expresslane.layers.lora_kernels import _split_k  # noqa: E402
from expresslane.quant.gemv import _arrive, _split, gemv_config  # noqa: E402
from expresslane.triton_setup import tl, triton  # noqa: E402
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: E402

RANK = 16
SLOTS = 9
LAYERS = 32
# (N, K, slice sizes): Llama-3-8B's merged projections
SHAPES = [(6144, 4096, [4096, 1024, 1024]), (4096, 4096, [4096]), (28672, 4096, [14336, 14336]), (4096, 14336, [4096])]


def copy_engine(out) -> None:
    dev = torch.device("cuda")
    small = torch.randint(0, 1000, (8192,), dtype=torch.int64).pin_memory()
    small_d = torch.empty_like(small, device=dev)
    big = torch.randn(42 * 1024 * 1024, dtype=torch.bfloat16).pin_memory()  # 84 MB: one rank-16 8B slot
    big_d = torch.empty_like(big, device=dev)
    main, side = torch.cuda.current_stream(), torch.cuda.Stream()

    def small_ms(pieces: int | None) -> float:
        torch.cuda.synchronize()
        if pieces:
            with torch.cuda.stream(side):
                for src, dst in zip(big.chunk(pieces), big_d.chunk(pieces)):
                    dst.copy_(src, non_blocking=True)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(main)
        small_d.copy_(small, non_blocking=True)
        end.record(main)
        torch.cuda.synchronize()
        return start.elapsed_time(end)

    torch.cuda.synchronize()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    big_d.copy_(big, non_blocking=True)
    t1.record()
    torch.cuda.synchronize()
    row = dict(probe="copy_engine", big_copy_ms=t0.elapsed_time(t1))
    for name, pieces in (("alone", None), ("beside_one_copy", 1), ("beside_8_pieces", 8), ("beside_64_pieces", 64)):
        times = [small_ms(pieces) for _ in range(10)]
        row[f"small_{name}_ms"] = float(np.median(times))
    emit(out, **row)


@triton.jit
def shrink_pdl_kernel(x_ptr, a_ptr, part_ptr, sorted_ptr, tiles_ptr, n, k, k_per_split, stride_x, stride_as,
                      stride_an, stride_ps, stride_pt, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr):
    """lora_shrink_kernel (bf16), letting the next kernel start at once."""
    gdc_launch_dependents()
    tile, pid_s = tl.program_id(0), tl.program_id(1)
    count = tl.load(tiles_ptr + tile * 3 + 2)
    if count == 0:
        return
    slot = tl.load(tiles_ptr + tile * 3)
    first = tl.load(tiles_ptr + tile * 3 + 1)
    offs = tl.arange(0, BLOCK_M)
    valid = offs < count
    rows = tl.load(sorted_ptr + first + offs, mask=valid, other=0).to(tl.int64)
    offs_n = tl.arange(0, BLOCK_N)
    mask_n = offs_n < n
    a_base = a_ptr + slot.to(tl.int64) * stride_as
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_lo = pid_s * k_per_split
    for k0 in range(k_lo, k_lo + k_per_split, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < k
        xt = tl.load(x_ptr + rows[:, None] * stride_x + offs_k[None, :], mask=valid[:, None] & mask_k[None, :],
                     other=0.0)
        at = tl.load(a_base + offs_n[None, :] * stride_an + offs_k[:, None], mask=mask_k[:, None] & mask_n[None, :],
                     other=0.0)
        acc += tl.dot(xt, at.to(xt.dtype))
    tl.store(part_ptr + pid_s * stride_ps + rows[:, None] * stride_pt + offs_n[None, :], acc,
             mask=valid[:, None] & mask_n[None, :])


@triton.jit
def gemv_lora_kernel(x_ptr, w_ptr, out_ptr, part_ptr, count_ptr, u_ptr, a_ptr, b_ptr, slot_ptr,
                     M, N, K, stride_xm, stride_om, SPLIT, K_SPLIT, R, bound1, bound2,
                     stride_us, stride_um, stride_as, stride_bs, stride_bn,
                     LORA: tl.constexpr, PDL: tl.constexpr, INLINE: tl.constexpr, U_SPLITS: tl.constexpr,
                     SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     BLOCK_R: tl.constexpr):
    """The split-K bf16 GEMV, then (LORA) each row's adapter delta in the tile's last program:
    u[row] (the shrink's partials, summed) @ B[slot(row), tile]^T. PDL: the shrink before it
    may still run; only the epilogue waits for it. INLINE (one adapter for every row, slot_ptr[0]):
    no shrink kernel; each program adds (x[K-slice] @ A[slice, K-slice]^T) @ B[tile]^T, its
    K-slice's share of the delta, before the split-K sum."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    x_rows = x_ptr + rm[:, None] * stride_xm
    k_lo = pid_k * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    rr = tl.arange(0, BLOCK_R)
    first = pid_n * BLOCK_N
    u_col = ((first >= bound1).to(tl.int32) + (first >= bound2).to(tl.int32)) * R
    if INLINE:
        slot = tl.load(slot_ptr)
        a_rows = a_ptr + slot.to(tl.int64) * stride_as + (u_col + rr).to(tl.int64)[:, None] * K
        u_acc = tl.zeros([BLOCK_R, BLOCK_M], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + rn.to(tl.int64)[:, None] * K + rk[None, :])
        x = tl.load(x_rows + rk[None, :], mask=m_ok[:, None] & (rk < K)[None, :], other=0.0)
        acc = tl.dot(w, tl.trans(x), acc)
        if INLINE:
            if slot > 0:
                a = tl.load(a_rows + rk[None, :])
                u_acc = tl.dot(a, tl.trans(x), u_acc)
    if INLINE:
        if slot > 0:
            b = tl.load(b_ptr + slot.to(tl.int64) * stride_bs + rn[:, None] * stride_bn + rr[None, :])
            acc = tl.dot(b, u_acc.to(b.dtype), acc)
    if SPLIT_K:
        acc, last = _arrive(part_ptr, count_ptr, acc, pid_n, pid_k, M, N, rm, rn, m_ok, n_ok, SPLIT)
    else:
        last = True
    if last:
        if LORA:
            if PDL:
                gdc_wait()
            r_ok = rr < R
            for m in range(M):
                slot = tl.load(slot_ptr + m)
                if slot > 0:
                    u = tl.zeros([BLOCK_R], tl.float32)
                    for s in tl.static_range(U_SPLITS):
                        u += tl.load(u_ptr + s * stride_us + m * stride_um + u_col + rr, mask=r_ok, other=0.0)
                    b = tl.load(b_ptr + slot.to(tl.int64) * stride_bs + rn[:, None] * stride_bn + rr[None, :],
                                mask=n_ok[:, None] & r_ok[None, :], other=0.0)
                    delta = tl.sum(b.to(tl.float32) * u[None, :], 1)
                    acc += tl.where(rm[None, :] == m, delta[:, None], 0.0)
        o = out_ptr + rm[None, :] * stride_om + rn[:, None]
        tl.store(o, acc.to(out_ptr.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])


class Projection:
    def __init__(self, n: int, k: int, slices: list[int], gen: torch.Generator):
        dev = torch.device("cuda")
        self.n, self.k = n, k
        self.w = (torch.randn(n, k, generator=gen, device=dev) * k ** -0.5).to(torch.bfloat16)
        self.a = (torch.randn(SLOTS, len(slices) * RANK, k, generator=gen, device=dev) * k ** -0.5).to(torch.bfloat16)
        self.b = (torch.randn(SLOTS, n, RANK, generator=gen, device=dev) * 0.01).to(torch.bfloat16)
        self.a[0].zero_()
        self.b[0].zero_()
        offs = np.cumsum([0] + slices)
        self.slices = [(int(offs[i]), s) for i, s in enumerate(slices)]
        self.x = torch.randn(1, k, generator=gen, device=dev).to(torch.bfloat16)


def run_shrink_pdl(p: Projection, step: LoRAStep, part: torch.Tensor) -> None:
    sorted_tokens, tiles, num_tiles = step.kernel_inputs(1)
    splits, k_per_split = _split_k(1, p.k)
    n = p.a.shape[1]
    shrink_pdl_kernel[(num_tiles, splits)](
        p.x, p.a, part, sorted_tokens, tiles, n, p.k, k_per_split, p.x.stride(0), p.a.stride(0), p.a.stride(1),
        part.stride(0), part.stride(1), BLOCK_M=SHRINK_BLOCK_M, BLOCK_N=max(16, triton.next_power_of_2(n)),
        BLOCK_K=SHRINK_BLOCK_K)


def gemv_lora(p: Projection, part: torch.Tensor | None, slots: torch.Tensor | None, pdl: bool,
              inline: bool = False) -> torch.Tensor:
    m = p.x.shape[0]
    cfg = gemv_config(p.n, False)
    tiles = triton.cdiv(p.n, cfg["block_n"])
    nsplit, k_split = _split(p.k, cfg["block_k"], tiles, None, cfg["programs"], 16)
    out = torch.empty(m, p.n, dtype=p.x.dtype, device=p.x.device)
    ws = torch.empty(nsplit, m, p.n, dtype=torch.float32, device=p.x.device) if nsplit > 1 else out
    bounds = [off for off, _ in p.slices[1:]] + [1 << 30] * (3 - len(p.slices))
    lora = part is not None
    gemv_lora_kernel[(tiles, nsplit)](
        p.x, p.w, out, ws, arrival_counters(p.x.device), part if lora else out, p.a, p.b,
        slots if lora or inline else out,
        m, p.n, p.k, p.x.stride(0), out.stride(0), nsplit, k_split, RANK, bounds[0], bounds[1],
        part.stride(0) if lora else 0, part.stride(1) if lora else 0, p.a.stride(0), p.b.stride(0), p.b.stride(1),
        LORA=lora, PDL=pdl and lora, INLINE=inline, U_SPLITS=part.shape[0] if lora else 1, SPLIT_K=nsplit > 1,
        BLOCK_M=16,
        BLOCK_N=cfg["block_n"], BLOCK_K=cfg["block_k"], BLOCK_R=RANK, num_warps=4, num_stages=cfg["stages"],
        launch_pdl=pdl and lora)
    return out


def projections(out) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    layers = [[Projection(n, k, s, gen) for n, k, s in SHAPES] for _ in range(LAYERS)]
    dev = torch.device("cuda")
    with_adapter = LoRAStep.of(np.array([1]), SLOTS, dev, groups=False)
    no_adapter = LoRAStep.static(1, SLOTS, dev)  # tiles all empty
    slot_one = torch.ones(1, dtype=torch.int32, device=dev)
    slot_none = torch.zeros(1, dtype=torch.int32, device=dev)
    side = torch.cuda.Stream()

    def current(p: Projection, step: LoRAStep) -> torch.Tensor:
        step.kernel_inputs(1)
        part = shrink_output(p.x, p.a)
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            lora_shrink(p.x, p.a, step, part)
        y = F.linear(p.x, p.w)
        main.wait_stream(side)
        lora_expand(part, p.b, y, p.slices, step)
        return y

    def serial(p: Projection, step: LoRAStep) -> torch.Tensor:
        y = F.linear(p.x, p.w)
        lora_expand(lora_shrink(p.x, p.a, step), p.b, y, p.slices, step)
        return y

    def fused(p: Projection, step: LoRAStep, slots: torch.Tensor, pdl: bool) -> torch.Tensor:
        step.kernel_inputs(1)
        part = shrink_output(p.x, p.a)
        if pdl:
            run_shrink_pdl(p, step, part)
        else:
            lora_shrink(p.x, p.a, step, part)
        return gemv_lora(p, part, slots, pdl)

    variants = {
        "base_cublas": lambda p: F.linear(p.x, p.w),
        "base_triton_gemv": lambda p: gemv_lora(p, None, None, False),
        "lora_current": lambda p: current(p, with_adapter),
        "lora_serial": lambda p: serial(p, with_adapter),
        "lora_fused_epilogue": lambda p: fused(p, with_adapter, slot_one, False),
        "lora_fused_epilogue_pdl": lambda p: fused(p, with_adapter, slot_one, True),
        "lora_inline": lambda p: gemv_lora(p, None, slot_one, False, inline=True),
        "noadapter_current": lambda p: current(p, no_adapter),
        "noadapter_inline": lambda p: gemv_lora(p, None, slot_none, False, inline=True),
        "noadapter_fused_pdl": lambda p: fused(p, no_adapter, slot_none, True),
    }
    # correctness of the fused paths against the reference, one layer
    for p in layers[0]:
        ref = F.linear(p.x.float(), p.w.float())
        for i, (off, size) in enumerate(p.slices):
            u = p.x.float() @ p.a[1, i * RANK:(i + 1) * RANK].float().t()
            ref[:, off:off + size] += u @ p.b[1, off:off + size].float().t()
        for name in ("lora_current", "lora_fused_epilogue", "lora_fused_epilogue_pdl", "lora_inline"):
            err = (variants[name](p).float() - ref).abs().max().item()
            emit(out, probe="projections_check", variant=name, n=p.n, k=p.k, max_abs_err=err,
                 ref_scale=ref.abs().max().item())
    for name, fn in variants.items():
        step_fn = lambda: [fn(p) for layer in layers for p in layer]  # noqa: E731
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                step_fn()
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step_fn()
        for _ in range(5):
            graph.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        reps = 50
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        ms = start.elapsed_time(end) / reps
        emit(out, probe="projections", variant=name, step_ms=ms, per_projection_us=ms * 1e3 / (LAYERS * 4))
        if name in PROFILED:
            profile_replays(out, name, graph)
        del graph


PROFILED = ("base_cublas", "base_triton_gemv", "lora_current", "lora_fused_epilogue_pdl", "lora_inline")


def profile_replays(out, name: str, graph, reps: int = 5) -> None:
    """Kernel time by kernel name, per step (CUPTI sees a graph's kernels), and the GPU's busy time."""
    from _shared import busy_us, kernel_intervals
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            graph.replay()
        torch.cuda.synchronize()
    spans = kernel_intervals(prof)
    by_name: dict[str, list[float]] = {}
    for start, end, kernel in spans:
        by_name.setdefault(kernel[:60], []).append(end - start)
    kernels = sorted(((k, sum(v) / reps, len(v) // reps) for k, v in by_name.items()), key=lambda t: -t[1])
    emit(out, probe="projections_profile", variant=name, busy_ms=busy_us(spans) / reps / 1e3,
         span_ms=(spans[-1][1] - spans[0][0]) / reps / 1e3 if spans else 0.0,
         kernels=[dict(name=k, ms=t / 1e3, launches=n) for k, t, n in kernels[:6]])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--only", choices=("copy_engine", "projections"), default=None,
                    help="one probe (default: the projections; the copy engine measured no contention on an H100)")
    args = ap.parse_args()
    if args.only == "copy_engine":
        copy_engine(args.out)
    if args.only in (None, "projections"):
        projections(args.out)


if __name__ == "__main__":
    main()
