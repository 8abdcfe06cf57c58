"""Fused elementwise ops: our Triton kernels vs torch.compile vs eager (issue #5 item 3).

    python benchmarks/fused_ops_compare.py [--out results.jsonl] [--tokens 1,64,512,8192] [--mode MODE]

Llama-3-8B shapes, bf16: RMSNorm + residual add, SiLU-and-mul on gate|up [T, 28672] (RoPE is
fused with the KV-cache write in the attention backend, not a separate op). One JSON line per (op, impl, tokens): device_us (per call, from
replays of a CUDA graph of 20 calls), launch_us (per call, eager calls back to back and one sync,
as step_profile.py: device-bound once the GPU can't keep up), host_us (that loop before its sync),
gb_per_s (minimal bytes moved / device_us; small T stays in the 60 MB L2 and may beat HBM) and
max_abs_diff against eager. torch.compile rounds to bf16 where eager does (emulate_precision_casts);
its failures are printed and reported as "error" rows, and the rest still runs.
"""

from __future__ import annotations

import argparse
import sys
import time
from functools import partial

import torch
import torch.nn.functional as F
from _shared import emit

from expresslane.bench.floors import H200_PEAK_BANDWIDTH as PEAK_BW

HIDDEN, INTER, EPS = 4096, 14336, 1e-5
CALLS = 20  # calls captured per CUDA graph


# Eager references = the torch paths of norm.py (forward + _norm) and activation.py.
def rms_eager(x, residual, weight):
    h = x + residual
    hf = h.float()
    return weight * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + EPS)).to(h.dtype), h


def silu_eager(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def as_list(out) -> list:
    return list(out) if isinstance(out, tuple) else [out]


def make_cases(t: int) -> dict:
    """op -> (inputs, our Triton call(s), minimal bytes read + written) at t tokens."""
    from expresslane.layers import triton_ops

    torch.manual_seed(t)
    bf = {"device": "cuda", "dtype": torch.bfloat16}
    x, res, w = torch.randn(t, HIDDEN, **bf), torch.randn(t, HIDDEN, **bf), 1 + 0.1 * torch.randn(HIDDEN, **bf)
    gate_up = torch.randn(t, 2 * INTER, **bf)
    return {
        "rms_norm_residual": ((x, res, w), lambda: triton_ops.rms_norm(x, w, EPS, res), (4 * t + 1) * HIDDEN * 2),
        "silu_and_mul": ((gate_up,), lambda: triton_ops.silu_and_mul(gate_up), 3 * t * INTER * 2),
    }


def device_us(fn) -> float:
    """Per-call device time: CALLS calls captured in one CUDA graph, replays timed with events."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up on a side stream, as the CUDA graphs docs do
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(CALLS):
            fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    replays = 1
    while True:  # the first passes warm up and size the one that counts (>= 20 ms)
        start.record()
        for _ in range(replays):
            g.replay()
        end.record()
        end.synchronize()
        ms = start.elapsed_time(end)
        if ms >= 20 or replays >= 1000:
            return ms * 1e3 / (replays * CALLS)
        replays = min(1000, max(2 * replays, int(replays * 25 / max(ms, 1e-3))))


def launch_us(fn, n: int = 100) -> tuple[float, float]:
    """Eager back-to-back calls, best of 3: (µs/call including the final sync, µs/call of the loop alone)."""
    totals, loops = [], []
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        loops.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        totals.append(time.perf_counter() - t0)
    return min(totals) / n * 1e6, min(loops) / n * 1e6


def measure(fn, ref: list, nbytes: int, name: str) -> dict:
    t0 = time.perf_counter()
    out = as_list(fn())
    torch.cuda.synchronize()
    row = {"first_call_s": round(time.perf_counter() - t0, 3),
           "max_abs_diff": max((o.float() - r.float()).abs().max().item() for o, r in zip(out, ref))}
    try:
        for o, r in zip(out, ref):
            torch.testing.assert_close(o, r, rtol=1.6e-2, atol=2e-2)  # bf16: ~1 ulp (reduction order, FMA)
    except AssertionError as e:
        print(f"MISMATCH {name}: {e}", file=sys.stderr)
        row["mismatch"] = True
    row["device_us"] = device_us(fn)
    row["launch_us"], row["host_us"] = launch_us(fn)
    row["gb_per_s"] = nbytes / row["device_us"] / 1e3
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--tokens", type=lambda s: [int(x) for x in s.split(",")], default=[1, 64, 512, 8192])
    ap.add_argument("--mode", default=None, help="torch.compile mode, e.g. max-autotune-no-cudagraphs")
    ap.add_argument("--no-emulate-casts", action="store_true", help="let inductor skip eager's bf16 roundings")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("fused_ops_compare: needs CUDA (GPU-only benchmark)", file=sys.stderr)
        sys.exit(2)
    from torch._inductor import config as inductor_config

    inductor_config.emulate_precision_casts = not args.no_emulate_casts
    eager = {"rms_norm_residual": rms_eager, "silu_and_mul": silu_eager}
    compiled = {op: torch.compile(fn, dynamic=False, fullgraph=True, mode=args.mode) for op, fn in eager.items()}
    failed: dict[str, str] = {}  # op -> torch.compile error, not retried at other T
    rows = []
    for t in args.tokens:
        for op, (inputs, triton_fn, nbytes) in make_cases(t).items():
            ref = as_list(eager[op](*inputs))
            impls = {"eager": partial(eager[op], *inputs), "triton": triton_fn, "compile": partial(compiled[op], *inputs)}
            for impl, fn in impls.items():
                row = {"bench": "fused_ops", "op": op, "impl": impl, "tokens": t}
                if impl == "compile":
                    row.update(mode=args.mode or "default", emulate_casts=not args.no_emulate_casts)
                if impl == "compile" and op in failed:
                    row["error"] = failed[op]
                else:
                    try:
                        row.update(measure(fn, ref, nbytes, f"{op} {impl} T={t}"))
                    except Exception as e:  # noqa: BLE001 - e.g. inductor with no C compiler on the box
                        print(f"{impl} failed for {op} T={t}: {e}", file=sys.stderr)
                        row["error"] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"[:300]
                        failed.update({op: row["error"]} if impl == "compile" else {})
                rows.append(row)
                emit(args.out, **row)

    print(f"\n{'op':<18}{'tokens':>7} {'impl':<8}{'device_us':>11}{'GB/s':>8}{'%copy':>7}"
          f"{'launch_us':>11}{'host_us':>9}{'max_diff':>10}")
    for op in eager:
        for t in args.tokens:
            group = [r for r in rows if r["op"] == op and r["tokens"] == t]
            best = min((r["device_us"] for r in group if "device_us" in r), default=None)
            for r in group:
                head = f"{op:<18}{t:>7} {r['impl']:<8}"
                if "device_us" not in r:
                    print(f"{head} failed: {r['error'][:70]}")
                    continue
                print(f"{head}{r['device_us']:>10.2f}{'*' if r['device_us'] == best else ' '}{r['gb_per_s']:>8.0f}"
                      f"{100 * r['gb_per_s'] * 1e9 / PEAK_BW:>6.0f}%{r['launch_us']:>11.2f}{r['host_us']:>9.2f}"
                      f"{r['max_abs_diff']:>10.3g}{'  MISMATCH' if r.get('mismatch') else ''}")
    print("* = fastest device time of its group; %copy = GB/s against the H200's ~4.27 TB/s device copy")


if __name__ == "__main__":
    main()
