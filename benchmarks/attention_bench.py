"""Attention kernels at long context against the library (issue #18 items 1-2): one layer of the
Llama-3-8B shape (32 query heads, 8 KV heads, head dim 128, pages of 16), bf16.

- prefill: one prompt of 512 / 4k / 16k / 32k tokens, and a 2048-token chunk after 6k and
  after 30k cached tokens (the default budget of 2048 tokens cuts a long prompt into such
  chunks; they run in the 2048-token mixed graph), over our paged cache for a sweep of prefill
  tiles, beside torch SDPA's flash and cuDNN backends on contiguous K/V: ms, TFLOP/s and % of
  the 805 TFLOP/s peak (causal FLOPs: 4 x heads x dim x visible query-key pairs);
- decode: batch 1 at 8k and 32k, batch 64 at 8k, for split counts and tiles, timed in CUDA
  graphs that cycle over enough layers' caches that L2 holds none between reads: KV TB/s and
  % of the 4.27 TB/s copy bandwidth.

Every tile first runs a 1000-token prompt and a 300-token chunk after 700 cached tokens (a
decode tile: 2 seqs of 1000) against float32 attention; a wrong tile stops the benchmark
(exit 1), as does a measured prefill that differs from SDPA's output. Last, a table: per case
the tile the tables in attention/triton_tiles.py pick (what the engine runs today), the fastest
tile, and the library; then, per key range of those tables, the tile with the best geometric
mean over its cases, written as entries to paste there.

    python benchmarks/attention_bench.py [--out results.jsonl] [--quick] [--shape HEADS:KV_HEADS:DIM]
    TRITON_INTERPRET=1 python benchmarks/attention_bench.py --smoke   # CPU: tiny shapes, float32
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from _shared import emit

from expresslane.attention.backend import AttentionMetadata
from expresslane.attention.library_prefill import chunk_attention
from expresslane.attention.torch_backend import gather_kv
from expresslane.attention.triton_backend import TritonAttentionBackend
from expresslane.attention.triton_tiles import DECODE_TILES, PREFILL_TILES, DecodeTile, PrefillTile, pick
from expresslane.bench.floors import H200_PEAK_BANDWIDTH as PEAK_BW
from expresslane.bench.floors import H200_PEAK_FLOPS as PEAK_FLOPS

HEADS, KV_HEADS, DIM, PAGE = 32, 8, 128, 16
TOL = 2e-2  # relative error of a bf16 attention output; a wrong one is ~1


def only(tile) -> dict:
    return {d: ((0, tile),) for d in (64, 128, 256)}


def name(tile) -> str:
    if isinstance(tile, PrefillTile):
        s = f"r{tile.rows}-n{tile.block_n}-w{tile.num_warps}-s{tile.num_stages}"
    else:
        s = f"max{tile.max_splits}x{tile.waves}-n{tile.block_n}-w{tile.num_warps}-s{tile.num_stages}"
        s += "-fused" if tile.fused_reduce else ""
    return s + ("-maskall" if tile.mask_all else "")


def prefill_tiles(quick: bool) -> list[PrefillTile]:
    """The tables' tiles, the default and the old every-tile-masked loop, then the sweep."""
    base = PrefillTile()
    sweep = [PrefillTile(rows=r, block_n=n, num_warps=w, num_stages=s)
             for r in (64, 128) for n in (64, 128) for w in (4, 8) for s in (2, 3)]
    # larger query tiles (fewer K/V bytes from L2 per FLOP); those ptxas compiles for sm_90 without
    # spilling, or with a few bytes (64 queries x a group of 4 per program)
    sweep += [PrefillTile(rows=128, block_n=32, num_warps=8), PrefillTile(rows=256, block_n=32, num_warps=8),
              PrefillTile(rows=256, block_n=32, num_warps=16), PrefillTile(rows=256, block_n=64, num_warps=16)]
    if quick:
        sweep = [PrefillTile(rows=128, block_n=64, num_warps=8), PrefillTile(rows=128, block_n=128, num_warps=8)]
    table = [tile for _, tile in PREFILL_TILES.get(DIM, ())]
    return list(dict.fromkeys(table + [base, dataclasses.replace(base, mask_all=True)] + sweep))


def decode_tiles(quick: bool) -> list[DecodeTile]:
    """The tables' tiles and the default; then split counts (waves=64: `max_splits` binds, up
    to 64 * SMs programs) by key tile, other warps / stages, and splits that combine
    themselves (`fused_reduce`)."""
    base = DecodeTile()
    shapes = [dict(), dict(block_n=32), dict(block_n=128, num_warps=8)]
    if DIM > 128:  # a wide head's K and V tiles: fewer keys a tile, fewer stages (shared memory)
        shapes = [dict(), dict(block_n=32), dict(block_n=16), dict(block_n=32, num_warps=8, num_stages=2)]
    splits = [DecodeTile(max_splits=s, waves=64, **kw) for s in ((8, 64) if quick else (4, 8, 16, 32, 64))
              for kw in shapes[:1 if quick else 3]]
    more = [] if quick else [dataclasses.replace(base, **kw) for kw in (
        dict(num_warps=8), dict(num_stages=2), dict(num_stages=4), dict(mask_all=True))]
    # the splits combined by their last program (no reduction kernel), at the default and at more splits
    more += [dataclasses.replace(tile, fused_reduce=True) for tile in (base, *splits[-2:])]
    return list(dict.fromkeys([tile for _, tile in DECODE_TILES.get(DIM, ())] + [base] + splits + more))


class Clock:
    """Milliseconds per call of `fn`: on CUDA the median over repeats of a CUDA graph of
    `calls` calls (or of the calls launched eagerly behind a GPU sleep, so the host has queued
    them before the first runs), between events; on CPU wall time."""

    def __init__(self, dev: torch.device, repeats: int):
        self.cuda, self.repeats = dev.type == "cuda", repeats

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def __call__(self, fn, graph: bool) -> float:
        fn()  # compiles
        self.sync()
        t = time.perf_counter()
        fn()
        self.sync()
        calls = max(1, min(50, round(2e-3 / max(time.perf_counter() - t, 1e-6))))  # >= ~2 ms per timing
        if not self.cuda:
            return (time.perf_counter() - t) * 1e3
        if graph:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _ in range(calls):
                    fn()
            run = g.replay
        else:
            def run():
                for _ in range(calls):
                    fn()
        run()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(self.repeats)]
        for a, b in events:
            if not graph:  # the GPU waits while the host queues the calls: no launch gaps timed
                torch.cuda._sleep(20_000_000)
            a.record()
            run()
            b.record()
        torch.cuda.synchronize()
        return statistics.median(a.elapsed_time(b) for a, b in events) / calls


def reference(q, k, v):
    """Float32 causal attention of q [L, H, D] (the last L positions) over k/v [ctx, KV, D]."""
    L, ctx = q.shape[0], k.shape[0]
    g = HEADS // KV_HEADS
    qf = q.float().transpose(0, 1)
    kf, vf = (x.float().repeat_interleave(g, 1).transpose(0, 1) for x in (k, v))
    s = qf @ kf.transpose(1, 2) * DIM ** -0.5
    keys, pos = torch.arange(ctx, device=q.device), torch.arange(ctx - L, ctx, device=q.device)
    s.masked_fill_(keys[None, None, :] > pos[None, :, None], float("-inf"))
    return (s.softmax(-1) @ vf).transpose(0, 1)


def rel_err(out, ref) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def paged(q_lens: list[int], ctx: int, dev, dtype, seed: int, decode: bool = False, refs: int = 2):
    """Seqs of `ctx` keys each on scattered pages, with q_lens[i] new tokens each; the
    metadata, and the first `refs` seqs' keys and values in token order ([ctx, KV, D])."""
    g = torch.Generator(device=dev).manual_seed(seed)
    b, per_seq = len(q_lens), -(-ctx // PAGE)
    table = torch.randperm(b * per_seq, device=dev, generator=g).to(torch.int32).view(b, per_seq)
    kv = torch.randn(2, b * per_seq, PAGE, KV_HEADS, DIM, device=dev, generator=g).to(dtype)
    q = torch.randn(sum(q_lens), HEADS, DIM, device=dev, generator=g).to(dtype)
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(qsl[-1], dtype=torch.int64, device=dev), block_tables=table,
        seq_lens=torch.full((b,), ctx, dtype=torch.int32, device=dev),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev), num_decodes=b if decode else 0,
        seq_lens_cpu=[ctx] * b, query_start_loc_cpu=qsl, max_decode_seq_len=ctx if decode else 0)
    kvs = [tuple(kv[j][table[i].long()].flatten(0, 1)[:ctx] for j in (0, 1)) for i in range(min(b, refs))]
    return q, kv, meta, kvs


def wrong(what: str, err: float) -> None:
    print(f"!!! WRONG OUTPUT: {what}: relative error {err:.3e} (> {TOL})", file=sys.stderr, flush=True)
    sys.exit(1)


FAILED: list[str] = []  # tiles that did not run: the benchmark exits 1 once it has measured the rest


def failed(out, tiles: list, tile, e: Exception) -> None:
    tiles.remove(tile)
    why = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    FAILED.append(f"{name(tile)}: {why}")
    print(f"!!! tile {name(tile)} did not run ({why}); left out", file=sys.stderr, flush=True)
    emit(out, bench="attn_check", tile=name(tile), failed=why)


def check_tiles(p_tiles, d_tiles, sizes, dev, dtype, out) -> dict:
    """Every tile against float32 attention on small cases, before anything is timed (exit 1 on a
    wrong one); the library too: which SDPA backends (per kind) are right, to compare with later."""
    lib_ok = {}
    for q_len, ctx in sizes:
        kind = "prompt" if q_len == ctx else "chunk"
        q, kv, meta, kvs = paged([q_len], ctx, dev, dtype, seed=q_len)
        ref = reference(q, *kvs[0])
        for tile in list(p_tiles):
            backend = TritonAttentionBackend(HEADS, KV_HEADS, DIM, dev, prefill_tiles=only(tile))
            backend.prepare(meta)
            try:
                got = backend.attend(q, kv, meta, DIM ** -0.5)
            except Exception as e:  # e.g. more shared memory than the GPU has: left out of the sweep
                failed(out, p_tiles, tile, e)
                continue
            err = rel_err(got, ref)
            emit(out, bench="attn_check", kind=kind, tile=name(tile), q_len=q_len, context=ctx, rel_err=err)
            if not err < TOL:
                wrong(f"prefill tile {name(tile)}, {q_len} tokens after {ctx - q_len}", err)
        for lib in ("flash", "cudnn"):
            fn, how, error = sdpa(lib, q, *kvs[0], q_len, ctx, pages=(kv, meta.block_tables[0]))
            err = None if fn is None else rel_err(fn().squeeze(0).transpose(0, 1), ref)
            lib_ok[lib, kind] = err is not None and err < TOL
            emit(out, bench="attn_check", kind=kind, impl=f"sdpa_{lib}", q_len=q_len, context=ctx, rel_err=err,
                 gqa=how, unavailable=error)
    for tile in list(d_tiles):
        ctx = sizes[0][1]
        q, kv, meta, kvs = paged([1, 1], ctx, dev, dtype, seed=1, decode=True)
        backend = TritonAttentionBackend(HEADS, KV_HEADS, DIM, dev, decode_tiles=only(tile))
        backend.prepare(meta)
        try:
            got = backend.attend(q, kv, meta, DIM ** -0.5)
        except Exception as e:
            failed(out, d_tiles, tile, e)
            continue
        err = max(rel_err(got[i:i + 1], reference(q[i:i + 1], *kvs[i])) for i in range(2))
        emit(out, bench="attn_check", kind="decode", tile=name(tile), splits=meta.num_splits, rel_err=err)
        if not err < TOL:
            wrong(f"decode tile {name(tile)} ({meta.num_splits} splits)", err)
    return lib_ok


def sdpa(lib: str, q, k, v, q_len: int, ctx: int, pages=None):
    """(fn, how, None): fn runs torch SDPA's `lib` backend ("flash" or "cudnn") on contiguous
    [1, heads, tokens, D] tensors, GQA natively if it takes it (how="native"), else over K/V
    expanded beforehand ("expanded"); or (None, None, why not). A chunk after cached tokens
    needs the causal mask aligned to the bottom right: flash's own op does that with
    is_causal (F.sdpa's is_causal aligns it to the top left); cuDNN has none, so it runs
    the chunk in two calls (`split_by_lse`, from `pages`: the paged cache and the block table)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if lib == "cudnn" and q_len != ctx:
        return split_by_lse(q, *pages, ctx)
    which = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[lib]
    qh = q.transpose(0, 1).unsqueeze(0).contiguous()
    kh, vh = (x.transpose(0, 1).unsqueeze(0).contiguous() for x in (k, v))
    errors = []
    for gqa in (True, False):
        kk, vv = (kh, vh) if gqa else (x.repeat_interleave(HEADS // KV_HEADS, 1) for x in (kh, vh))
        if q_len != ctx:
            def fn(kk=kk, vv=vv):
                return torch.ops.aten._scaled_dot_product_flash_attention(qh, kk, vv, 0.0, True, False,
                                                                         scale=DIM ** -0.5)[0]
        else:
            def fn(kk=kk, vv=vv, gqa=gqa):
                with sdpa_kernel(which):
                    return F.scaled_dot_product_attention(qh, kk, vv, is_causal=True, scale=DIM ** -0.5,
                                                          enable_gqa=gqa)
        try:
            fn()
            return fn, "native" if gqa else "expanded", None
        except (RuntimeError, ValueError, NotImplementedError) as e:
            errors.append(f"{'gqa' if gqa else 'expanded'}: {str(e).splitlines()[0][:160]}")
    return None, None, "; ".join(errors)


def split_by_lse(q, kv, table, ctx: int):
    """A chunk after cached keys through cuDNN, which has no bottom-right causal mask: the
    engine's `library_prefill` path (two calls merged by their log-sum-exps; on CPU torch's
    flash op stands in), timed as the engine runs it: K/V gathered from the pages inside each
    call, grouped. (fn, how, None), or (None, None, why not)."""
    out = torch.empty_like(q)

    def fn():
        k, v = (x[0] for x in gather_kv(kv, table[None], ctx))
        chunk_attention(q, k, v, DIM ** -0.5, out)
        return out.transpose(0, 1).unsqueeze(0)  # as SDPA's [1, H, L, D]
    try:
        fn()
        return fn, "split, gathered K/V", None
    except (RuntimeError, ValueError, NotImplementedError) as e:
        return None, None, f"split: {str(e).splitlines()[0][:160]}"


def bench_prefill(cases, tiles, lib_ok, dev, dtype, clock, out) -> list[dict]:
    rows = []
    for kind, q_len, ctx in cases:
        q, kv, meta, kvs = paged([q_len], ctx, dev, dtype, seed=q_len + ctx)
        pairs = q_len * (ctx - q_len) + q_len * (q_len + 1) // 2
        flops = 4 * HEADS * DIM * pairs
        case = dict(kind=kind, q_len=q_len, context=ctx)

        def row(impl, tile, ms, **extra):
            r = dict(bench="attn_prefill", **case, impl=impl, tile=tile, ms=round(ms, 4),
                     tflops=round(flops / ms / 1e9, 1), pct_of_peak=round(100 * flops / ms / 1e-3 / PEAK_FLOPS, 1),
                     **extra)
            emit(out, **r)
            rows.append(r)

        ref_name = ref = None  # the output of a library backend found right on the small case
        for lib in ("flash", "cudnn"):
            fn, how, error = sdpa(lib, q, *kvs[0], q_len, ctx, pages=(kv, meta.block_tables[0]))
            if fn is None:
                emit(out, bench="attn_prefill", **case, impl=f"sdpa_{lib}", unavailable=error)
                continue
            if ref is None and lib_ok.get((lib, kind)):
                ref_name, ref = lib, fn().squeeze(0).transpose(0, 1)
            row(f"sdpa_{lib}", "-", clock(fn, graph=False), gqa=how, right_on_small_case=lib_ok.get((lib, kind)))
            del fn
        del kvs
        in_table = pick(PREFILL_TILES, DIM, q_len, PrefillTile())  # what the engine runs for this step
        for tile in dict.fromkeys([in_table] + tiles):
            backend = TritonAttentionBackend(HEADS, KV_HEADS, DIM, dev, prefill_tiles=only(tile))
            backend.prepare(meta)

            def fn(backend=backend):
                return backend.attend(q, kv, meta, DIM ** -0.5)
            got = fn()
            err = None if ref is None else rel_err(got, ref)
            if err is not None and not err < TOL:
                wrong(f"prefill tile {name(tile)} vs sdpa_{ref_name}, {q_len} tokens after {ctx - q_len}", err)
            del got
            row("triton", name(tile), clock(fn, graph=True), rel_err_vs_sdpa=err, in_table=tile == in_table)
    return rows


def cold_caches(kv: torch.Tensor, read: int) -> list[torch.Tensor]:
    """`kv` and enough caches like it (4x L2 in all) that a loop over them, one layer each,
    finds none of a layer's `read` bytes in L2."""
    dev = kv.device
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size if dev.type == "cuda" else 1 << 20
    return [kv] + [torch.randn_like(kv, dtype=torch.float32).to(kv.dtype) for _ in range(-(-4 * l2 // read) - 1)]


def ms_per_layer(clock: Clock, backend: TritonAttentionBackend, q, meta, layers: list[torch.Tensor]) -> float:
    """One layer's attention, timed over a CUDA graph of a pass through the `layers` caches."""
    def fn():
        for layer in layers:
            backend.attend(q, layer, meta, DIM ** -0.5)
    return clock(fn, graph=True) / len(layers)


def bench_decode(cases, tiles, dev, dtype, clock, out) -> list[dict]:
    rows = []
    for batch, ctx in cases:
        q, kv, meta, kvs = paged([1] * batch, ctx, dev, dtype, seed=batch + ctx, decode=True)
        ref = reference(q[:1], *kvs[0])
        del kvs
        read = batch * ctx * KV_HEADS * DIM * 2 * kv.element_size()  # K and V of every seq
        layers = cold_caches(kv, read)
        in_table = pick(DECODE_TILES, DIM, batch, DecodeTile())
        for tile in dict.fromkeys([in_table] + tiles):
            backend = TritonAttentionBackend(HEADS, KV_HEADS, DIM, dev, decode_tiles=only(tile))
            backend.prepare(meta)
            err = rel_err(backend.attend(q, kv, meta, DIM ** -0.5)[:1], ref)
            if not err < TOL:
                wrong(f"decode tile {name(tile)} ({meta.num_splits} splits), batch {batch} x {ctx}", err)
            ms = ms_per_layer(clock, backend, q, meta, layers)
            r = dict(bench="attn_decode", batch=batch, context=ctx, splits=meta.num_splits, tile=name(tile),
                     us=round(ms * 1e3, 2), kv_tb_per_s=round(read / ms / 1e9, 3),
                     pct_of_bw=round(100 * read / ms / 1e-3 / PEAK_BW, 1), layers=len(layers), rel_err=err,
                     in_table=tile == in_table)
            emit(out, **r)
            rows.append(r)
        del layers, kv
    return rows


def table(prefill: list[dict], decode: list[dict], out) -> None:
    """Per case: the table's tile (the first measured: what the engine runs today), the fastest
    tile, the library; as result rows, then printed."""
    lines = ["", "== attention kernels: the table's tile (today's) / the fastest tile / the library",
             f"{'prefill TFLOP/s (% of peak)':<28}{'table tile':>14}{'fastest tile':>34}{'sdpa flash':>14}"
             f"{'sdpa cudnn':>14}"]

    def tf(r, tile=False):
        return "-" if r is None else (f"{r['tile']} " if tile else "") + f"{r['tflops']:.0f} ({r['pct_of_peak']:.0f}%)"
    for key in dict.fromkeys((r["kind"], r["q_len"], r["context"]) for r in prefill):
        rs = [r for r in prefill if (r["kind"], r["q_len"], r["context"]) == key]
        ours = [r for r in rs if r["impl"] == "triton"]
        lib = {r["impl"]: r for r in rs if r["impl"] != "triton"}
        if not ours:
            continue
        base, best = next(r for r in ours if r["in_table"]), max(ours, key=lambda r: r["tflops"])
        emit(out, bench="attn_prefill_best", kind=key[0], q_len=key[1], context=key[2], table_tile=base["tile"],
             table_tflops=base["tflops"], best_tile=best["tile"], best_tflops=best["tflops"],
             **{f"{k}_tflops": v["tflops"] for k, v in lib.items()})
        label = f"{key[0]} {key[1]}" + (f" after {key[2] - key[1]}" if key[0] == "chunk" else "")
        lines.append(f"{label:<28}{tf(base):>14}{tf(best, True):>34}{tf(lib.get('sdpa_flash')):>14}"
                     f"{tf(lib.get('sdpa_cudnn')):>14}")
    lines.append(f"{'decode KV TB/s (% of copy)':<28}{'table tile':>20}{'fastest tile':>44}")

    def bw(r, tile=False):
        return (f"{r['tile']} " if tile else "") + f"{r['splits']}sp {r['kv_tb_per_s']:.2f} ({r['pct_of_bw']:.0f}%)"
    for key in dict.fromkeys((r["batch"], r["context"]) for r in decode):
        rs = [r for r in decode if (r["batch"], r["context"]) == key]
        base, best = next(r for r in rs if r["in_table"]), max(rs, key=lambda r: r["kv_tb_per_s"])
        emit(out, bench="attn_decode_best", batch=key[0], context=key[1], table_tile=base["tile"],
             table_splits=base["splits"], table_tb_per_s=base["kv_tb_per_s"], best_tile=best["tile"],
             best_splits=best["splits"], best_tb_per_s=best["kv_tb_per_s"])
        lines.append(f"{f'batch {key[0]} x {key[1]}':<28}{bw(base):>20}{bw(best, True):>44}")
    print("\n".join(lines), flush=True)


def suggest(prefill: list[dict], decode: list[dict], tiles: list, out) -> None:
    """Per key range of the tile tables (at this head dim): the tile with the best geometric mean
    over the cases measured in that range (prefill: by query tokens; decode: by batch), as
    entries to paste into attention/triton_tiles.py. Ranges no case falls in keep their tile."""
    by_name = {name(t): t for t in tiles}
    picks = []
    for table, rows, key, score in ((PREFILL_TILES, [r for r in prefill if r["impl"] == "triton"], "q_len", "tflops"),
                                    (DECODE_TILES, decode, "batch", "kv_tb_per_s")):
        lows = [low for low, _ in table.get(DIM, ((0, None),))]
        for i, low in enumerate(lows):
            high = lows[i + 1] if i + 1 < len(lows) else float("inf")
            rs = [r for r in rows if low <= r[key] < high]
            cases = {(r[key], r["context"]) for r in rs}
            names = [n for n in dict.fromkeys(r["tile"] for r in rs)
                     if sum(r["tile"] == n for r in rs) == len(cases)]  # measured in every case
            if not names:
                continue
            def gm(rs):
                return statistics.geometric_mean([max(r[score], 1e-9) for r in rs])
            gmean = {n: gm([r for r in rs if r["tile"] == n]) for n in names}
            best, today = max(names, key=gmean.get), gm([r for r in rs if r["in_table"]])
            picks.append(f"    ({low}, {by_name[best]!r}),  # {sorted(cases)}: {gmean[best]:.2f} {score} "
                         f"(the table's today: {today:.2f})")
            emit(out, bench="attn_suggest", table="prefill" if table is PREFILL_TILES else "decode", key=low,
                 tile=best, score=round(gmean[best], 3), table_score=round(today, 3), unit=score)
    print(f"\n== suggested entries for attention/triton_tiles.py (head dim {DIM})\n" + "\n".join(picks), flush=True)


def cases_arg(text: str) -> list[tuple[str, ...]]:
    return [tuple(case.split(":")) for case in text.split(",") if case]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true", help="fewer tiles and cases (default: off)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes in float32, on CPU with TRITON_INTERPRET=1")
    ap.add_argument("--repeats", type=int, default=7, help="timings per figure, the median kept (default: 7)")
    ap.add_argument("--prefill-cases", type=cases_arg, default=None,
                    help="instead of the default prefill cases: 'prompt:N' or 'chunk:TOKENS:CONTEXT', comma-separated")
    ap.add_argument("--decode-cases", type=cases_arg, default=None,
                    help="instead of the default decode cases: 'BATCH:CONTEXT', comma-separated ('' for none)")
    ap.add_argument("--shape", default=None, help="another layer shape, HEADS:KV_HEADS:DIM (e.g. gemma-3-12b's "
                    "16:8:256; default: the Llama-3-8B layer's 32:8:128)")
    args = ap.parse_args()
    if args.shape:
        global HEADS, KV_HEADS, DIM
        HEADS, KV_HEADS, DIM = (int(x) for x in args.shape.split(":"))
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type != "cuda" and not args.smoke:
        ap.error("needs a CUDA device (or --smoke on CPU with TRITON_INTERPRET=1)")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    p_tiles, d_tiles = prefill_tiles(args.quick or args.smoke), decode_tiles(args.quick or args.smoke)
    if args.smoke:
        p_tiles, d_tiles = p_tiles[:3], d_tiles[:2]
        p_cases, d_cases = [("prompt", 96, 96), ("chunk", 32, 160)], [(1, 200), (4, 64)]
    elif args.quick:
        p_cases, d_cases = [("prompt", 4096, 4096), ("chunk", 2048, 32768)], [(1, 32768), (64, 8192), (64, 1024)]
    else:
        # the engine's long-context cases first (what a run cut short still measured)
        p_cases = [("chunk", 2048, 32768), ("prompt", 32768, 32768), ("chunk", 2048, 8192)] + [
            ("prompt", n, n) for n in (16384, 4096, 512)]
        # batch 64 at 1k as well: the split count is fixed per batch size, and more splits that win
        # at 8k cost the engine's 1k-context decode
        d_cases = [(1, 32768), (64, 8192), (1, 8192), (64, 1024), (256, 1024)]
    p_cases = p_cases if args.prefill_cases is None else [
        (c[0], int(c[1]), int(c[-1])) for c in args.prefill_cases]  # a prompt's context is its tokens
    d_cases = d_cases if args.decode_cases is None else [(int(b), int(c)) for b, c in args.decode_cases]
    p_tiles = p_tiles if p_cases else []  # a decode-only run checks no prefill tile
    sizes = [(96, 96), (40, 96)] if args.smoke else [(1000, 1000), (300, 1000)]
    lib_ok = check_tiles(p_tiles, d_tiles, sizes, dev, dtype, args.out)
    clock = Clock(dev, args.repeats)
    prefill = bench_prefill(p_cases, p_tiles, lib_ok, dev, dtype, clock, args.out)
    decode = bench_decode(d_cases, d_tiles, dev, dtype, clock, args.out)
    table(prefill, decode, args.out)
    suggest(prefill, decode, p_tiles + d_tiles, args.out)
    if FAILED:
        sys.exit("tiles that did not run: " + "; ".join(FAILED))


if __name__ == "__main__":
    main()
