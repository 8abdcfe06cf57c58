"""Issue #41 probes on the GPU, each printed as one JSON line:

- copy_engine: does a LoRA slot load (a large pinned host-to-device copy on a side stream)
  hold up a step's own small input copy on the main stream? Small copy latency alone, beside
  one big copy, and beside the same bytes cut into pieces.
- projections: one decode step's projections at batch 1 (Llama-3-8B shapes, 32 layers x
  qkv / o / gate|up / down, distinct weights so L2 holds none), captured in a CUDA graph,
  per variant: the base model (cuBLAS, or the split-K Triton GEMV) and `LoRALinear`'s paths: the
  one-token GEMV with the adapter inline (as served at batch 1), and the two-kernel path that
  larger steps take (the shrink beside cuBLAS or before it, then the expand). The prototypes session 26 measured beside
  them (the expand in a Triton GEMV's epilogue, with and without PDL) are in commit d0f2e6e.

    python benchmarks/lora_probe.py [--out results.jsonl]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _shared import emit  # noqa: E402

from expresslane.layers.lora import LoRALinear, LoRAState, LoRAStep  # noqa: E402
from expresslane.quant.gemv import gemv  # noqa: E402

RANK = 16
SLOTS = 9
LAYERS = 32
# (N, K, slice sizes): Llama-3-8B's merged projections
SHAPES = [(6144, 4096, [4096, 1024, 1024]), (4096, 4096, [4096]), (28672, 4096, [14336, 14336]),
          (4096, 14336, [4096])]


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


def projections(out) -> None:
    """Each variant runs the library's own paths: `LoRALinear` as the engine builds it, with the
    step and the side stream set per variant."""
    dev = torch.device("cuda")
    torch.manual_seed(0)
    state = LoRAState(SLOTS, RANK, use_triton=True, dtype=torch.bfloat16)
    layers = []
    for _ in range(LAYERS):
        layer = []
        for n, k, sizes in SHAPES:
            offs = np.cumsum([0] + sizes)
            base = nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
            layer.append(LoRALinear(base, [(int(offs[i]), s) for i, s in enumerate(sizes)], sizes, k, state))
        layers.append(layer)
    modules = [m for layer in layers for m in layer]
    state.allocate(modules, dev)
    for m in modules:
        for slot in range(1, SLOTS):
            m.lora_a[slot].copy_(torch.randn_like(m.lora_a[slot]) * m.base.in_features ** -0.5)
            m.lora_b[slot].copy_(torch.randn_like(m.lora_b[slot]) * 0.01)
        m.x = torch.randn(1, m.base.in_features, device=dev, dtype=torch.bfloat16)
        m.x64 = torch.randn(64, m.base.in_features, device=dev, dtype=torch.bfloat16)
    with_adapter = LoRAStep.of(np.array([1]), SLOTS, dev, groups=False)
    eight = LoRAStep.of(np.arange(64) % 8 + 1, SLOTS, dev, groups=False)  # batch 64 over 8 adapters
    no_adapter = LoRAStep.static(1, SLOTS, dev)  # tiles all empty: what a decode graph replays for the base model
    side = state.side_stream
    tiles = [m.inline_tile for m in modules]
    # (the step, the shrink's side stream, one-token steps inline); None: the split-K Triton GEMV alone.
    # *_b64: 64 rows (the two-kernel path; 8 adapters, 8 rows each)
    variants = {"base_cublas": (None, side, False), "base_triton_gemv": None,
                "lora_inline": (with_adapter, None, True), "noadapter_inline": (no_adapter, None, True),
                "lora_twokernel": (with_adapter, side, False), "lora_serial": (with_adapter, None, False),
                "noadapter_twokernel": (no_adapter, side, False), "base_cublas_b64": (None, side, False),
                "lora_b64": (eight, side, False)}

    def configure(name: str):
        if variants[name] is None:
            return lambda m: gemv(m.x, m.base.weight, None, None)
        state.step, state.side_stream, one = variants[name]
        for m, tile in zip(modules, tiles):
            m.inline_tile = tile if one else None
        return (lambda m: m(m.x64)) if name.endswith("_b64") else (lambda m: m(m.x))

    for name in ("lora_inline", "lora_twokernel", "lora_serial"):  # against float32 sums, one layer
        run = configure(name)
        for m in layers[0]:
            ref = m.x.float() @ m.base.weight.float().t()
            for i, (off, size) in enumerate(m.slices):
                u = m.x.float() @ m.lora_a[1, i * RANK:(i + 1) * RANK].float().t()
                ref[:, off:off + size] += u.bfloat16().float() @ m.lora_b[1, off:off + size].float().t()
            emit(out, probe="projections_check", variant=name, n=m.base.out_features, k=m.base.in_features,
                 max_abs_err=(run(m).float() - ref).abs().max().item(), ref_scale=ref.abs().max().item())
    for name in variants:
        run = configure(name)
        step_fn = lambda: [run(m) for m in modules]  # noqa: E731
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
        emit(out, probe="projections", variant=name, step_ms=ms, per_projection_us=ms * 1e3 / len(modules))
        if name in PROFILED:
            profile_replays(out, name, graph)
        del graph


PROFILED = ("base_triton_gemv", "lora_inline", "lora_twokernel", "lora_b64")


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
