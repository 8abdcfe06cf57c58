"""Can a prefill and a decode run at the same time on one Hopper GPU in this stack, and which launch
setup makes them (issue "pdmux")? A prefill-like load (``--prefill-gemms`` bf16 GEMMs of
``--prefill-rows`` x hidden x intermediate) and a decode-like load (``--decode-gemvs`` GEMVs of
``--decode-batch`` rows, each against its own intermediate x hidden weight, so every call streams
its weights from HBM), random normal data, timed alone and together under each setup:

  plain              two ordinary non-default streams, one thread, the prefill launched first
  priority           as plain, the decode's stream at the highest priority (the lowest number of
                     torch.cuda.Stream.priority_range()), the prefill's at the lowest
  priority+splitK    as priority, each prefill GEMM cut into K row chunks (``--chunks``): more kernel
                     boundaries, where the block scheduler can start the decode's blocks
  green              torch.cuda.green_contexts: N SMs (``--decode-sms``) for the decode, the rest
                     (rounded down to the partition granule) for the prefill, each stream made inside
                     its context; green+balanced too where create() takes workqueue_scope
  green+threads      as green, each load launched from its own thread (released together by a
                     barrier), each thread with its own context current
  green-split        the same partition made through the driver (ctypes): one
                     cuDevSmResourceSplitByCount, the decode on the N-SM group, the prefill on the
                     remainder, disjoint by construction (torch's create() splits every context from
                     the whole device, so two of its contexts may share SMs); +threads as above
  graph...           the decode captured once as a CUDA graph on its stream and replayed: beside
                     the prefill on plain streams, with priority, and on both kinds of green context

Each figure is the median over ``--reps`` runs after ``--warmup``, from CUDA events on the load's
own stream: the decode from its first launch to its completion, the prefill likewise. Together:
every stream synchronized, the prefill launched, then the decode (or both at once from their
threads). Alone: the same load on the same stream and SMs with nothing beside it. A setup overlaps
when the decode together takes at most 1.5x its time alone and the prefill at most 1.2x. The
makespan (a plain stream's event before both launches to one after both ends) is set against
the sum of the two alone.

Printed first: the torch green-context API as found at run time, the floors (the decode's weight
bytes over a device-to-device copy's bandwidth, the prefill's FLOPs over a big bf16 matmul's rate,
both measured here), and for each green partition the SMs its kernels really ran on (a Triton
probe reading %smid), so a partition other than the one asked for shows. Last: a markdown table,
one row per setup; the rows also go as JSON to ``--out`` (default $OUT/pdmux_overlap.json when OUT
is set).

    python benchmarks/pdmux_overlap.py [--connections 32] [--decode-batch 32] [--only green]

``--connections`` sets CUDA_DEVICE_MAX_CONNECTIONS before torch loads (CUDA reads it once, when it
initialises): to compare values, run the script once per value.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import statistics
import sys
import threading

DECODE_SLACK, PREFILL_SLACK = 1.5, 1.2  # "overlaps": together at most these times alone
GRANULE = 8  # Hopper splits SMs in groups of 8: the prefill's torch green context asks for a multiple
PROBE_SPIN_NS = 20_000  # each %smid probe program holds its SM this long, so the programs spread out

torch = triton = tl = None  # imported in main() (after --connections is in the environment) and sm_sets()


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--connections", type=int, default=None,
                    help="CUDA_DEVICE_MAX_CONNECTIONS, set before torch loads (default: as in the environment)")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--intermediate", type=int, default=14336)
    ap.add_argument("--prefill-rows", type=int, default=8192)
    ap.add_argument("--prefill-gemms", type=int, default=6)
    ap.add_argument("--decode-gemvs", type=int, default=32, help="GEMVs per decode, each with its own weight")
    ap.add_argument("--decode-batch", type=int, default=1, help="rows of each decode GEMV (e.g. 1 or 32)")
    ap.add_argument("--decode-sms", default="16,32,48", help="SMs of the decode's green context, comma-separated")
    ap.add_argument("--chunks", default="8,16", help="row chunks per prefill GEMM for priority+split, comma-separated")
    ap.add_argument("--reps", type=int, default=20, help="timed runs per figure, the median kept (default: 20)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed runs before them (default: 3)")
    ap.add_argument("--only", default=None, help="run only setups whose name starts with one of these (comma-separated)")
    ap.add_argument("--no-push", action="store_true",
                    help="green-split: launch onto its streams without making their context current (SGLang's way)")
    ap.add_argument("--out", default=os.path.join(os.environ["OUT"], "pdmux_overlap.json") if os.environ.get("OUT")
                    else None, help="JSON of the rows (default: $OUT/pdmux_overlap.json when OUT is set)")
    return ap.parse_args()


class Lane:
    """A stream, the SMs its kernels may use (and how many of them the other lane may use too), and
    what makes its context current around its launches (nothing for a primary-context stream)."""

    def __init__(self, stream, sms: int, shared: int = 0, enter=None, leave=None, keep=None, how: str = ""):
        self.stream, self.sms, self.shared, self.enter, self.leave = stream, sms, shared, enter, leave
        self.keep, self.how = keep, how  # keep: the green context object, alive as long as its stream

    @contextlib.contextmanager
    def current(self):
        if self.enter:
            self.enter()
        try:
            with torch.cuda.stream(self.stream):  # never the legacy default stream
                yield
        finally:
            if self.leave:
                self.leave()


class Loads:
    """The two loads' tensors (random normal: zeros would let the tensor cores idle) and launches.
    Outputs are preallocated, so no launch allocates (nor differs between streams and contexts)."""

    def __init__(self, a: argparse.Namespace):
        def randn(*shape, scale=1.0):
            return torch.randn(*shape, device="cuda", dtype=torch.bfloat16).mul_(scale)

        h, i = a.hidden, a.intermediate
        self.x, self.y = randn(a.prefill_rows, h), randn(a.prefill_rows, i)
        self.w = [randn(i, h, scale=0.02) for _ in range(a.prefill_gemms)]  # (out, in), as nn.Linear
        self.xd, self.yd = randn(a.decode_batch, h), randn(a.decode_batch, i)
        self.wd = [randn(i, h, scale=0.02) for _ in range(a.decode_gemvs)]  # distinct: HBM, not L2
        self.decode_bytes = sum(w.numel() * w.element_size() for w in self.wd)
        self.prefill_flops = 2 * a.prefill_rows * h * i * a.prefill_gemms

    def prefill(self, chunks: int = 1):
        step = -(-self.x.shape[0] // chunks)
        parts = [(self.x[r:r + step], self.y[r:r + step]) for r in range(0, self.x.shape[0], step)]

        def run():
            for w in self.w:
                for x, y in parts:
                    torch.mm(x, w.t(), out=y)
        return run

    def decode(self):
        def run():
            for w in self.wd:
                torch.mm(self.xd, w.t(), out=self.yd)
        return run


def as_graph(lane: Lane, fn):
    """fn captured once as a CUDA graph on lane's stream (in its context); returns its replay."""
    g = torch.cuda.CUDAGraph()
    with lane.current():
        fn()  # cuBLAS settles its workspace for this stream outside the capture
        lane.stream.synchronize()
        with torch.cuda.graph(g, stream=lane.stream):
            fn()
    return g.replay


def run_once(hub: Lane, jobs, threaded: bool) -> tuple[list[float], float]:
    """Launch each job (lane, fn) between two events on its lane's stream: in order from this
    thread, or each from its own thread released by a barrier. An event on the hub (a plain
    stream) before, which every lane waits for, and one after, which waits for every lane, give the
    makespan without comparing events of two contexts. Returns ms per job and the makespan."""
    for lane, _ in jobs:
        lane.stream.synchronize()
    torch.cuda.synchronize()
    new = lambda: torch.cuda.Event(enable_timing=True)  # noqa: E731
    first, last, marks = new(), new(), [(new(), new()) for _ in jobs]
    gate = threading.Barrier(len(jobs)) if threaded else None
    errors = []

    def go(k):
        (lane, fn), (start, end) = jobs[k], marks[k]
        try:
            with lane.current():  # events are made (on first record) in the lane's context
                if gate:
                    gate.wait()
                lane.stream.wait_event(first)
                start.record(lane.stream)
                fn()
                end.record(lane.stream)
        except BaseException as e:  # noqa: BLE001 - handed to the caller below
            errors.append(e)
            if gate:
                gate.abort()

    first.record(hub.stream)
    if threaded:
        threads = [threading.Thread(target=go, args=(k,)) for k in range(len(jobs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:
        for k in range(len(jobs)):
            go(k)
    if errors:
        torch.cuda.synchronize()
        raise errors[0]
    for _, end in marks:
        hub.stream.wait_event(end)
    last.record(hub.stream)
    last.synchronize()
    for lane, _ in jobs:
        lane.stream.synchronize()
    return [s.elapsed_time(e) for s, e in marks], first.elapsed_time(last)


def measure(hub: Lane, jobs, args, threaded: bool = False, reps: int | None = None) -> tuple[list[float], float]:
    """Median ms of each job and of the makespan over `reps` (default --reps) runs after --warmup."""
    times, spans = [[] for _ in jobs], []
    for rep in range(args.warmup + (reps or args.reps)):
        ms, span = run_once(hub, jobs, threaded)
        if rep >= args.warmup:
            for k, t in enumerate(ms):
                times[k].append(t)
            spans.append(span)
    return [statistics.median(t) for t in times], statistics.median(spans)


def compare(setup: str, hub: Lane, lanes: tuple[Lane, Lane], decode, prefill, args, threaded=False) -> dict:
    """One row: the decode and the prefill alone on their lanes, then together."""
    dec, pre = lanes
    (d_alone,), _ = measure(hub, [(dec, decode)], args)
    (p_alone,), _ = measure(hub, [(pre, prefill)], args)
    (p_tog, d_tog), span = measure(hub, [(pre, prefill), (dec, decode)], args, threaded)
    d_ratio, p_ratio = d_tog / d_alone, p_tog / p_alone
    row = dict(setup=setup, decode_sms=dec.sms, shared_sms=dec.shared, prefill_sms=pre.sms,
               decode_stream=dec.how, prefill_stream=pre.how, threads=threaded,
               decode_alone_ms=round(d_alone, 3), decode_together_ms=round(d_tog, 3), decode_ratio=round(d_ratio, 2),
               prefill_alone_ms=round(p_alone, 3), prefill_together_ms=round(p_tog, 3),
               prefill_ratio=round(p_ratio, 2), makespan_ms=round(span, 3), serial_ms=round(d_alone + p_alone, 3),
               overlaps=d_ratio <= DECODE_SLACK and p_ratio <= PREFILL_SLACK)
    print(f"  {setup:26s} decode SMs {dec.sms:3d}: decode {d_alone:6.2f} -> {d_tog:6.2f} ms ({d_ratio:.2f}x), prefill "
          f"{p_alone:6.2f} -> {p_tog:6.2f} ms ({p_ratio:.2f}x), makespan {span:6.2f} vs {d_alone + p_alone:6.2f} ms",
          flush=True)
    return row


def floors(hub: Lane, loads: Loads, args) -> dict:
    """Measured copy bandwidth and bf16 matmul rate, and the two loads' floors on the whole GPU."""
    src = torch.randn(1 << 29, device="cuda", dtype=torch.bfloat16)  # 1 GiB
    dst = torch.empty_like(src)
    (copy_ms,), _ = measure(hub, [(hub, lambda: dst.copy_(src))], args, reps=5)
    bandwidth = 2 * src.numel() * src.element_size() / (copy_ms * 1e-3)  # read + write, as floors.py counts
    del src, dst
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    c = torch.empty_like(a)
    (mm_ms,), _ = measure(hub, [(hub, lambda: torch.mm(a, b, out=c))], args, reps=5)
    rate = 2 * 8192 ** 3 / (mm_ms * 1e-3)
    del a, b, c
    torch.cuda.empty_cache()
    out = dict(copy_tb_per_s=round(bandwidth / 1e12, 3), bf16_tflop_per_s=round(rate / 1e12, 1),
               decode_bytes=loads.decode_bytes, decode_floor_ms=round(loads.decode_bytes / bandwidth * 1e3, 3),
               prefill_flops=loads.prefill_flops, prefill_floor_ms=round(loads.prefill_flops / rate * 1e3, 3))
    print(f"floors: copy {out['copy_tb_per_s']} TB/s -> decode ({loads.decode_bytes / 1e9:.2f} GB of weights) "
          f">= {out['decode_floor_ms']} ms; bf16 matmul {out['bf16_tflop_per_s']} TFLOP/s -> prefill "
          f"({loads.prefill_flops / 1e12:.2f} TFLOP) >= {out['prefill_floor_ms']} ms", flush=True)
    return out


def green_api() -> dict:
    """What torch.cuda.green_contexts offers in this torch (it changed between releases): create()'s
    signature, the class's and a made context's attributes."""
    from torch.cuda.green_contexts import GreenContext
    params = inspect.signature(GreenContext.create).parameters
    api = dict(create=str(inspect.signature(GreenContext.create)), workqueue_scope="workqueue_scope" in params,
               attributes=[n for n in dir(GreenContext) if not n.startswith("__")])
    try:
        ctx = GreenContext.create(num_sms=2 * GRANULE, device_id=0)
        api["object"] = f"{type(ctx).__module__}.{type(ctx).__qualname__}: " + \
            ", ".join(n for n in dir(ctx) if not n.startswith("__"))
        del ctx
    except Exception as e:  # noqa: BLE001 - reported; the green setups will fail with their own reasons
        api["object"] = f"create() failed: {e!r}"
    print(f"torch green contexts: GreenContext.create{api['create']}; class attributes {api['attributes']}; "
          f"a context: {api['object']}", flush=True)
    return api


def torch_green_stream(ctx, drv) -> tuple[object, str]:
    """A stream of torch green context ctx, made while ctx is current: its own Stream() where torch
    has one, else torch.cuda.Stream() if that one really belongs to ctx, else a driver stream.
    (torch.cuda.Stream() hands out streams of a pool made once per process, here before any green
    context: they belong to the primary context, whatever context is current.)"""
    ctx.set_context()
    try:
        pooled = torch.cuda.Stream()
        pooled_green = drv.green_of(pooled.cuda_stream) if drv else None
        owner = {None: "unknown", 0: "the primary context"}.get(pooled_green, "this green context")
        note = f"torch.cuda.Stream() inside set_context belongs to {owner}"
        if hasattr(ctx, "Stream"):
            return ctx.Stream(), f"GreenContext.Stream() ({note})"
        if pooled_green or drv is None:
            return pooled, note
        return torch.cuda.ExternalStream(drv.stream_here()), f"cuStreamCreate inside set_context ({note})"
    finally:
        ctx.pop_context()


def torch_green_lanes(n: int, total: int, drv, scope: str | None = None) -> tuple[Lane, Lane]:
    """(decode, prefill) lanes on torch green contexts of n and total - n SMs (rounded down to the granule)."""
    from torch.cuda.green_contexts import GreenContext
    extra = {"workqueue_scope": scope} if scope else {}
    lanes = []
    for sms in (n, (total - n) // GRANULE * GRANULE):
        ctx = GreenContext.create(num_sms=sms, device_id=0, **extra)
        stream, how = torch_green_stream(ctx, drv)
        if drv:
            how += f"; its green context {'set' if drv.green_of(stream.cuda_stream) else 'NOT set'}"
        lanes.append(Lane(stream, sms, enter=ctx.set_context, leave=ctx.pop_context, keep=ctx, how=how))
    return lanes[0], lanes[1]


def driver_green_lanes(n: int, total: int, drv, push: bool) -> tuple[Lane, Lane]:
    """(decode, prefill) lanes on the two disjoint green contexts of one driver split."""
    made, counted = drv.split(n)
    lanes = []
    for green, ctx, sms in made:
        stream = torch.cuda.ExternalStream(drv.green_stream(green))
        granted = f"{sms} SMs granted" if counted == total else "SMs granted unread (CUdevResource layout?)"
        lanes.append(Lane(stream, sms if counted == total else n, enter=(lambda c=ctx: drv.push(c)) if push else None,
                          leave=drv.pop if push else None, how=f"cuGreenCtxStreamCreate, {granted}"
                          + ("" if push else ", launched without its context current")))
    return lanes[0], lanes[1]


# A Triton kernel (jitted in sm_sets: a plain function here, so that --help needs no Triton): each
# program stores the id of the SM it ran on, after holding that SM for spin_ns.
def _smid_probe(out_ptr, spin_ns):
    t0 = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
    sm = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
    t = t0
    while t - t0 < spin_ns:
        t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
    tl.store(out_ptr + tl.program_id(0), sm)


def sm_sets(hub: Lane, lanes: tuple[Lane, Lane], total: int) -> list[set[int]]:
    """The SMs each lane's kernels ran on (8 probe programs per SM of the device, launched as the
    loads are); sets each lane's SM count to what it got and the decode's `shared` to the overlap."""
    global triton, tl
    import triton
    import triton.language as tl
    kernel = triton.jit(_smid_probe)
    out = torch.full((8 * total,), -1, device="cuda", dtype=torch.int32)
    with hub.current():  # compiled and loaded in the primary context first
        kernel[(out.numel(),)](out, PROBE_SPIN_NS, num_warps=1)
    torch.cuda.synchronize()
    seen = []
    for lane in lanes:
        with lane.current():
            out.fill_(-1)
            kernel[(out.numel(),)](out, PROBE_SPIN_NS, num_warps=1)
        lane.stream.synchronize()
        seen.append(set(out.tolist()) - {-1})
    for lane, sms in zip(lanes, seen):
        lane.sms = len(sms)
    lanes[0].shared = len(seen[0] & seen[1])
    return seen


def ranges(ids: set[int]) -> str:
    """SM ids as ranges: '0-15,32-47'."""
    ids, out = sorted(ids), []
    for i in ids:
        if out and i == out[-1][1] + 1:
            out[-1][1] = i
        else:
            out.append([i, i])
    return ",".join(f"{a}-{b}" if a != b else f"{a}" for a, b in out)


def table(rows: list[dict]) -> str:
    head = ["setup", "decode SMs", "decode alone (ms)", "decode together (ms)", "ratio", "prefill alone (ms)",
            "prefill together (ms)", "ratio", "overlaps?", "makespan / serial (ms)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        sms = f"{r['decode_sms']}" + (f" ({r['shared_sms']} shared)" if r["shared_sms"] else "")
        lines.append(f"| {r['setup']} | {sms} | {r['decode_alone_ms']:.2f} | {r['decode_together_ms']:.2f} | "
                     f"{r['decode_ratio']:.2f} | {r['prefill_alone_ms']:.2f} | {r['prefill_together_ms']:.2f} | "
                     f"{r['prefill_ratio']:.2f} | {'yes' if r['overlaps'] else 'no'} | "
                     f"{r['makespan_ms']:.2f} / {r['serial_ms']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    if args.connections is not None:
        os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = str(args.connections)
    global torch
    import torch
    if not torch.cuda.is_available():
        sys.exit("pdmux_overlap needs a CUDA GPU")
    torch.cuda.init()
    props = torch.cuda.get_device_properties(0)
    total = props.multi_processor_count
    try:
        from expresslane.cuda_driver import Driver
        drv = Driver()
        driver = drv.version()
    except Exception as e:  # noqa: BLE001 - green-split is left out, the rest runs
        drv, driver = None, f"no driver API ({e})"
    # (least, greatest) priority; a lower number is a higher priority. torch clamps the device's
    # range to the priorities its stream pools have.
    least, greatest = torch.cuda.Stream.priority_range()
    high, low = min(least, greatest), max(least, greatest)
    # the plain streams first: torch's stream pool is made once, in whatever context is current then
    hub = Lane(torch.cuda.Stream(), total, how="hub")
    plain = tuple(Lane(torch.cuda.Stream(), total, total, how="torch.cuda.Stream()") for _ in range(2))
    prio = (Lane(torch.cuda.Stream(priority=high), total, total, how=f"priority {high}"),
            Lane(torch.cuda.Stream(priority=low), total, total, how=f"priority {low}"))
    env = dict(device=props.name, sms=total, torch=torch.__version__, cuda=torch.version.cuda, driver=driver,
               connections=os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "unset (8)"),
               priority_range=[least, greatest], decode_priority=prio[0].stream.priority,
               prefill_priority=prio[1].stream.priority, args=vars(args))
    print(f"{props.name}, {total} SMs; torch {torch.__version__}, CUDA {torch.version.cuda}, driver {driver}; "
          f"CUDA_DEVICE_MAX_CONNECTIONS {env['connections']}; priority_range() = ({least}, {greatest}): "
          f"decode stream priority {env['decode_priority']}, prefill {env['prefill_priority']}", flush=True)
    try:
        env["green_api"] = green_api()
    except Exception as e:  # noqa: BLE001
        env["green_api"] = dict(error=repr(e), workqueue_scope=False)
        print(f"torch green contexts unavailable: {e!r}", flush=True)

    loads = Loads(args)
    floor = floors(hub, loads, args)
    decode, prefill = loads.decode(), loads.prefill()
    wanted = lambda name: args.only is None or any(name.startswith(p) for p in args.only.split(","))  # noqa: E731
    rows, failed, seen_sms, kept = [], [], {}, []

    def attempt(name: str, fn, always: bool = False):
        """Run one setup (or a step towards some) unless --only leaves it out; a failure is printed
        and recorded, and the script goes on."""
        if not (always or wanted(name)):
            return None
        try:
            out = fn()
        except Exception as e:  # noqa: BLE001
            reason = f"{type(e).__name__}: {e}".splitlines()[0][:300]
            failed.append(dict(setup=name, error=reason))
            print(f"  {name}: not measured: {reason}", flush=True)
            return None
        if isinstance(out, dict):
            rows.append(out)
        return out

    print("setups (alone -> together):", flush=True)
    attempt("plain", lambda: compare("plain", hub, plain, decode, prefill, args))
    attempt("priority", lambda: compare("priority", hub, prio, decode, prefill, args))
    for k in (int(c) for c in args.chunks.split(",")):
        attempt(f"priority+split{k}", lambda: compare(f"priority+split{k}", hub, prio, decode, loads.prefill(k), args))
    attempt("graph", lambda: compare("graph", hub, plain, as_graph(plain[0], decode), prefill, args))
    attempt("graph+priority", lambda: compare("graph+priority", hub, prio, as_graph(prio[0], decode), prefill, args))

    def green_rows(kind: str, n: int, make) -> None:
        """The kind, kind+threads and graph+kind rows on one pair of green lanes (`make` makes them)."""
        names = [f"{kind} {n}", f"{kind}+threads {n}", f"graph+{kind} {n}"]
        if not any(map(wanted, names)):
            return
        lanes = attempt(f"{kind} {n} (making its green contexts)", make, always=True)
        if lanes is None:
            return
        kept.append(lanes)  # contexts and streams stay alive until the end, as do the graphs' pools
        ids = attempt(f"{kind} {n} (SM probe)", lambda: sm_sets(hub, lanes, total), always=True)
        if ids:
            seen_sms[names[0]] = dict(decode=ranges(ids[0]), prefill=ranges(ids[1]), shared=len(ids[0] & ids[1]))
        print(f"  {names[0]}: decode kernels ran on " + (
            f"{len(ids[0])} SMs ({ranges(ids[0])}), prefill on {len(ids[1])} ({ranges(ids[1])}), "
            f"{len(ids[0] & ids[1])} shared" if ids else "? SMs (no probe)")
            + f"; decode stream: {lanes[0].how}; prefill stream: {lanes[1].how}", flush=True)
        attempt(names[0], lambda: compare(names[0], hub, lanes, decode, prefill, args))
        attempt(names[1], lambda: compare(names[1], hub, lanes, decode, prefill, args, threaded=True))
        attempt(names[2], lambda: compare(names[2], hub, lanes, as_graph(lanes[0], decode), prefill, args))

    if not env["green_api"]["workqueue_scope"] and wanted("green+balanced"):
        failed.append(dict(setup="green+balanced", error="this torch's GreenContext.create() has no workqueue_scope"))
    for n in (int(s) for s in args.decode_sms.split(",")):
        green_rows("green", n, lambda: torch_green_lanes(n, total, drv))
        if env["green_api"]["workqueue_scope"]:
            green_rows("green+balanced", n, lambda: torch_green_lanes(n, total, drv, scope="balanced"))
        if drv is not None:
            green_rows("green-split", n, lambda: driver_green_lanes(n, total, drv, push=not args.no_push))
    if drv is None and wanted("green-split"):
        failed.append(dict(setup="green-split", error=f"driver API: {driver}"))

    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(env=env, floors=floor, sm_sets=seen_sms, failed=failed, rows=rows), f, indent=1)
    for f in failed:
        print(f"not measured: {f['setup']}: {f['error']}")
    print(f"\noverlaps: decode together <= {DECODE_SLACK}x alone and prefill together <= {PREFILL_SLACK}x alone, "
          f"each on its own lane; CUDA_DEVICE_MAX_CONNECTIONS {env['connections']}, decode batch {args.decode_batch}\n")
    print(table(rows), flush=True)
    # Leave without the interpreter's teardown, which would destroy green contexts, their streams
    # and captured graphs in no particular order (a failing destructor there aborts the process).
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
