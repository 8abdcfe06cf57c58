"""Every tile shape of the Triton attention kernels (the tables of triton_tiles.py and the shapes
the GPU benchmark sweeps) against the torch reference on fresh random inputs; the prefill work
list's order; which key tiles run masked. On CPU through Triton's interpreter, on CUDA for real."""

import numpy as np
import pytest
import torch

from expresslane.attention.torch_backend import TorchAttentionBackend
from expresslane.attention.triton_tiles import (DECODE_TILES, FP8_DECODE_TILES, PREFILL_TILES, DecodeTile, PrefillTile,
                                               pick)
from expresslane.layers.rotary import RotaryEmbedding
from test_triton_attention import DEVICE, make_step

triton_backend = pytest.importorskip("expresslane.attention.triton_backend")
triton_kernels = pytest.importorskip("expresslane.attention.triton_kernels")

PREFILL = sorted({tile for entries in PREFILL_TILES.values() for _, tile in entries} | {
    PrefillTile(rows=128, block_n=128, num_warps=8, num_stages=2), PrefillTile(rows=256, block_n=32, num_warps=8),
    PrefillTile(rows=16, block_n=32),
    PrefillTile(mask_all=True)}, key=repr)
FP8_DECODE = sorted({tile for entries in FP8_DECODE_TILES.values() for _, tile in entries}, key=repr)
DECODE = sorted({tile for entries in DECODE_TILES.values() for _, tile in entries} | set(FP8_DECODE) | {
    DecodeTile(max_splits=3, waves=64), DecodeTile(max_splits=24, waves=64, block_n=16),
    DecodeTile(block_n=32, mask_all=True), DecodeTile(fused_reduce=True),
    DecodeTile(max_splits=24, waves=64, block_n=16, fused_reduce=True)}, key=repr)
SHAPES = [(2, 2, 64), (8, 2, 128), (6, 2, 64)]  # query heads, KV heads, head dim: groups of 1, 4 and 3 (padded)
# a decode; a prompt that ends mid-tile; prefix-cached chunks (within a tile, and across several)
PREFILL_STEP = [(40, 1), (0, 75), (130, 21), (3, 50)]
DECODE_STEP = [(200, 1), (1, 1), (16, 1), (15, 1), (0, 1), (77, 1)]
DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])


def tile_shapes(tiles: list, shapes: list) -> list:
    """(tile, shape) cases: every pair on CUDA; through the interpreter (CPU, where each case costs
    seconds) each tile on one shape in turn, every shape at least once: each tile's loop and each
    shape's masks (head groups, padded head dims) still run."""
    if DEVICE.type == "cuda":
        return [(t, sh) for t in tiles for sh in shapes]
    return [(tiles[i % len(tiles)], shapes[i % len(shapes)]) for i in range(max(len(tiles), len(shapes)))]


def fp8(kv: torch.Tensor, scales) -> torch.Tensor:
    """The cache as --kv-cache-dtype fp8 holds it: k / k_scale, v / v_scale in e4m3."""
    out = torch.empty(kv.shape, dtype=torch.float8_e4m3fn, device=kv.device)
    for i in (0, 1):
        out[i] = (kv[i].float() / scales[i]).clamp(-448, 448).to(torch.float8_e4m3fn)
    return out


def only(tile) -> dict:
    """A tile table holding `tile` for every head dim and key."""
    return {d: ((0, tile),) for d in (16, 32, 64, 128, 256)}


def check(backend, heads, kv_heads, dim, seqs, dtype, seed, kv_scales=None):
    """The backend's attention over a cache against the torch reference over the same values
    (rounded to `dtype`, or to e4m3 with `kv_scales`)."""
    q, k, v, kv, meta, pos = make_step(seqs, heads, kv_heads, dim, 16, torch.float32, seed)
    ref_backend = TorchAttentionBackend()
    q = ref_backend.store(pos, q, k, v, RotaryEmbedding(dim, 512, 10000.0).to(q.device), kv, meta)
    scales = kv_scales or (1.0, 1.0)
    kv = fp8(kv, scales) if kv_scales else kv.to(dtype)
    q = q.to(dtype)
    backend.prepare(meta)
    ref = ref_backend.attend(q.float(), kv if kv_scales else kv.float(), meta, dim ** -0.5, scales)
    out = backend.attend(q, kv, meta, dim ** -0.5, scales).float()
    assert torch.isfinite(out).all()
    err = (out - ref).norm() / ref.norm()
    assert err < (1e-5 if dtype == torch.float32 else 1e-2), f"relative error {err:.2e}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tile,shape", tile_shapes(PREFILL, SHAPES), ids=repr)
def test_every_prefill_tile_matches_torch(tile, shape, dtype):
    backend = triton_backend.TritonAttentionBackend(*shape, DEVICE, prefill_tiles=only(tile), kv_dtype=dtype)
    if backend.prefill_tile(len(PREFILL_STEP)) != tile:
        pytest.skip(f"the K/V pipeline does not fit this GPU's shared memory in {dtype} (the backend falls back)")
    check(backend, *shape, PREFILL_STEP, dtype, seed=10 * PREFILL.index(tile) + SHAPES.index(shape))


@pytest.mark.parametrize("tile", PREFILL, ids=repr)
def test_every_prefill_tile_over_an_fp8_cache(tile):
    backend = triton_backend.TritonAttentionBackend(6, 2, 64, DEVICE, prefill_tiles=only(tile),
                                                    kv_dtype=torch.float8_e4m3fn)
    check(backend, 6, 2, 64, PREFILL_STEP, torch.float32, seed=7, kv_scales=(0.5, 3.0))


@pytest.mark.parametrize("tile,shape", tile_shapes(DECODE, SHAPES[1:]), ids=repr)
def test_every_decode_tile_matches_torch(tile, shape):
    backend = triton_backend.TritonAttentionBackend(*shape, DEVICE, decode_tiles=only(tile))
    assert backend.num_splits(len(DECODE_STEP)) == min(tile.max_splits, -(-tile.waves * backend.sms // (
        len(DECODE_STEP) * shape[1])))
    check(backend, *shape, DECODE_STEP, torch.float32, seed=3)
    if tile.fused_reduce:  # the last split of each (seq, KV head) combined them and reset its counter
        from expresslane.device import arrival_counters
        assert int(arrival_counters(torch.device(DEVICE)).abs().sum()) == 0


@pytest.mark.parametrize("tile", FP8_DECODE, ids=repr)
def test_every_decode_tile_of_the_fp8_table_over_an_fp8_cache(tile):
    backend = triton_backend.TritonAttentionBackend(8, 2, 128, DEVICE, decode_tiles=only(tile),
                                                    kv_dtype=torch.float8_e4m3fn)
    check(backend, 8, 2, 128, DECODE_STEP, torch.float32, seed=5, kv_scales=(0.5, 3.0))


def test_an_fp8_cache_takes_its_own_decode_table():
    fp8_backend = triton_backend.TritonAttentionBackend(32, 8, 128, DEVICE, kv_dtype=torch.float8_e4m3fn)
    bf16_backend = triton_backend.TritonAttentionBackend(32, 8, 128, DEVICE, kv_dtype=torch.bfloat16)
    assert fp8_backend.decode_tile(64) == pick(FP8_DECODE_TILES, 128, 64, None) != bf16_backend.decode_tile(64)
    assert fp8_backend.decode_tile(1) == bf16_backend.decode_tile(1)


def test_tables_pick_by_key_and_head_dim():
    a, b = PrefillTile(rows=16), PrefillTile(rows=128)
    table = {128: ((0, a), (1024, b))}
    assert pick(table, 128, 1023, None) is a and pick(table, 128, 1024, None) is b
    assert pick(table, 64, 5000, "default") == "default"
    with pytest.raises(ValueError, match="rows"):
        PrefillTile(rows=48)


def test_a_tile_that_does_not_fit_the_shared_memory_falls_back():
    """r128-n128 with 3 stages needs 192 KiB of K/V tiles in bf16 (fits an H200's 227 KiB), 384 KiB
    in float32 (does not: the default tile runs)."""
    big = PrefillTile(rows=128, block_n=128, num_warps=8)
    kw = dict(prefill_tiles=only(big), smem_bytes=232448)
    assert big.kv_smem_bytes(128, 2) == 3 * 2 * 128 * 128 * 2
    assert triton_backend.TritonAttentionBackend(8, 2, 128, DEVICE, kv_dtype=torch.bfloat16, **kw).prefill_tile(
        4096) == big
    backend = triton_backend.TritonAttentionBackend(8, 2, 128, DEVICE, kv_dtype=torch.float32, **kw)
    assert backend.prefill_tile(4096) == PrefillTile()
    assert backend.max_prefill_work(4096, 1) == 4096 // backend.block_q(PrefillTile()) + 1 + backend.split_rows


def test_prefill_work_list_longest_first():
    """Every tile of query tokens once, in decreasing order of the keys it attends to."""
    backend = triton_backend.TritonAttentionBackend(8, 2, 128, DEVICE)
    tile = PrefillTile(rows=32)  # 8 tokens per item (group 4)
    qsl = [0, 1, 2, 77, 98, 148]  # two decodes, then prefill chunks of 75, 21, 50 tokens
    lens = [41, 9, 75, 151, 53]
    work = backend.plan_prefill(qsl, lens, 2, tile)
    expected = {(s, off, 0, 1, 0) for s in (2, 3, 4) for off in range(0, qsl[s + 1] - qsl[s], 8)}
    assert len(work) == len(expected) and {tuple(w) for w in work.tolist()} == expected
    q_len = np.diff(qsl)[work[:, 0]]
    ctx = np.asarray(lens)[work[:, 0]]
    keys = np.minimum(ctx, ctx - q_len + work[:, 1] + 8)
    assert (np.diff(keys) <= 0).all() and keys[0] == 151
    assert backend.plan_prefill([0, 1, 41], [9, 50], 1, tile).tolist() == [
        [1, off, 0, 1, 0] for off in (32, 24, 16, 8, 0)]


def test_a_short_chunk_after_a_long_context_is_split_over_its_keys():
    """The H200's geometry (132 SMs; Llama-3-8B heads: 8 KV heads, 16 query tokens an item): a
    24-token chunk after 8,000 cached tokens is 2 items, 16 programs, each reading 8k keys. Cut
    into slices of >= 512 keys, up to two waves: 15 slices each, in 30 partial slots; every
    (item, slice) once, each item's slices adjacent with slots of their own."""
    backend = triton_backend.TritonAttentionBackend(32, 8, 128, DEVICE)
    backend.sms = 132
    work = backend.plan_prefill([0, 1, 25], [300, 8024], 1, PrefillTile())
    assert work.shape == (30, 5) and backend.max_prefill_work(32, 2) >= 30
    for off, slot in ((16, 0), (0, 15)):  # the later tile sees more keys: it starts first
        mine = work[work[:, 1] == off]
        assert mine[:, 0].tolist() == [1] * 15 and mine[:, 2].tolist() == list(range(15))
        assert (mine[:, 3] == 15).all() and (mine[:, 4] == slot).all()
    # a full wave already (a long chunk, or many seqs): nothing is split
    assert (backend.plan_prefill([0, 2048], [10048], 0, PrefillTile())[:, 3] == 1).all()
    # a short context: slices would be too short to pay
    assert (backend.plan_prefill([0, 24], [900], 0, PrefillTile())[:, 3] == 1).all()


def test_a_long_item_beside_a_full_wave_is_split_to_the_fair_share():
    """A mixed step on the H200's geometry: a 512-token prompt (32 items, 256 programs: more
    than a wave) beside a decode at 8k keys and one at 100. Whole, the decode's 8 programs
    would each read 8k keys while the prompt's read at most 512 (7 ms more a step on the H200).
    It is cut to the fair share: its 8,192 keys plus the prompt's 8,448 and the short decode's
    100, over 2 waves of 132 programs, x 8 KV heads: 508 keys, so slices of 512. The short
    decode and the prompt's items stay whole; the slots fit `split_rows`, the rows the grid."""
    backend = triton_backend.TritonAttentionBackend(32, 8, 128, DEVICE, prefill_tiles=only(PrefillTile()))
    backend.sms = 132
    qsl, lens = [0, 1, 2, 514], [8192, 100, 512]
    work = backend.plan_prefill(qsl, lens, 0, PrefillTile())
    long = work[work[:, 0] == 0]
    assert long[:, 2].tolist() == list(range(16)) and (long[:, 3] == 16).all() and (long[:, 4] == 0).all()
    assert (work[work[:, 0] != 0][:, 3] == 1).all()
    assert long[:, 3].max() <= backend.split_rows and len(work) <= backend.max_prefill_work(514, 3)
    # many decodes at 8k beside it: the fair share grows, each is cut less, the slots still fit
    work = backend.plan_prefill([0, 1, 2, 3, 4, 5, 517], [8192] * 5 + [512], 0, PrefillTile())
    split = work[work[:, 3] > 1]
    assert set(split[:, 0].tolist()) == set(range(5)) and (split[:, 3] == 5).all()
    assert len(split) <= backend.split_rows and len(work) <= backend.max_prefill_work(517, 6)


@pytest.mark.parametrize("tile,shape", tile_shapes(
    sorted({t for entries in PREFILL_TILES.values() for _, t in entries}, key=repr), SHAPES), ids=repr)
def test_split_prefill_items_match_torch(monkeypatch, tile, shape):
    """Prefill items cut over their keys (slices of >= 16 keys here; 64 SMs, so the few items of
    these steps all split) combine to the reference: chunks after long and short contexts, a
    prompt, beside decodes; the last split to finish writes the rows."""
    monkeypatch.setattr(triton_backend.TritonAttentionBackend, "SPLIT_MIN_KEYS", 16)
    seqs = [(40, 1), (300, 5), (130, 21), (0, 40)]
    for dtype in DTYPES:  # (a tile too big for the shared memory in this dtype falls back, split too)
        backend = triton_backend.TritonAttentionBackend(*shape, DEVICE, prefill_tiles=only(tile), kv_dtype=dtype)
        backend.sms = 64
        check(backend, *shape, seqs, dtype, seed=5)
        meta = make_step(seqs, *shape, 16, torch.float32, 5)[4]
        backend.prepare(meta)
        assert meta.prefill_work[:, 3].max() > 1


@pytest.mark.parametrize("mask_all", [False, True])
def test_only_tiles_crossing_the_diagonal_are_masked(monkeypatch, mask_all):
    """Counts the kernel's key tiles by kind (through the interpreter): each covers its keys
    once; masked tiles are those crossing the diagonal (at most rows/BLOCK_N + 1 per item) or a
    decode split's ragged end; the prefix before a chunk and every full split run unmasked."""
    if DEVICE.type != "cpu":
        pytest.skip("counts the interpreter's calls")
    calls = {True: 0, False: 0}
    real = triton_kernels._attend_keys
    at = real.arg_names.index("CAUSAL")

    def counted(*args):
        causal = args[at]
        calls[bool(getattr(causal, "value", causal))] += 1
        return real(*args)

    monkeypatch.setattr(triton_kernels, "_attend_keys", counted)
    heads, kv_heads, dim, block_n = 8, 2, 64, 32
    tile = PrefillTile(rows=64, block_n=block_n, mask_all=mask_all)  # 16 tokens per item
    backend = triton_backend.TritonAttentionBackend(
        heads, kv_heads, dim, DEVICE, prefill_tiles=only(tile),
        decode_tiles=only(DecodeTile(max_splits=2, waves=64, block_n=block_n, mask_all=mask_all)))
    check(backend, heads, kv_heads, dim, [(100, 1), (0, 75), (130, 21)], torch.float32, seed=5)
    # prefill: per item, keys 0..hi in tiles; keys <= the item's first position in whole tiles unmasked
    masked = unmasked = 0
    for cached, n in ((0, 75), (130, 21)):
        for off in range(0, n, 16):
            first, hi = cached + off, min(cached + n, cached + off + 16)
            full = (first + 1) // block_n
            unmasked += full
            masked += -(-hi // block_n) - full
            assert -(-hi // block_n) - full <= -(-16 // block_n) + 1
    # decode: 101 keys in 2 splits of 64: one full split (2 tiles), one of 37 keys (1 full tile + a ragged one)
    unmasked, masked = unmasked + 3, masked + 1
    if mask_all:
        unmasked, masked = 0, unmasked + masked
    assert calls == {False: unmasked * kv_heads, True: masked * kv_heads}
