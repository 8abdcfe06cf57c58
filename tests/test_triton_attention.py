"""Triton attention kernels against the torch reference backend, on fresh random inputs
(on CPU through Triton's interpreter, on CUDA for real)."""

import random

import pytest
import torch

from expresslane.attention.backend import AttentionMetadata
from expresslane.attention.torch_backend import TorchAttentionBackend
from expresslane.layers.rotary import RotaryEmbedding

triton_backend = pytest.importorskip("expresslane.attention.triton_backend")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def make_step(seqs, num_heads, num_kv_heads, head_dim, block_size, dtype, seed):
    """seqs: list of (cached_len, new_len); decodes (new_len 1) must come first."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    blocks_per_seq = [-(-(c + n) // block_size) for c, n in seqs]
    num_blocks = sum(blocks_per_seq) + 3
    ids = list(range(num_blocks))
    rng.shuffle(ids)  # blocks of a seq are scattered, as in a real cache
    tables, slots, starts, lens, positions = [], [], [0], [], []
    for (c, n), nb in zip(seqs, blocks_per_seq):
        table = [ids.pop() for _ in range(nb)]
        tables.append(table)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(c, c + n)]
        positions += range(c, c + n)
        starts.append(starts[-1] + n)
        lens.append(c + n)
    t = starts[-1]
    width = max(blocks_per_seq)
    kv = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    q = torch.randn(t, num_heads, head_dim, generator=g).to(dtype)
    k = torch.randn(t, num_kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(t, num_kv_heads, head_dim, generator=g).to(dtype)
    nd = sum(1 for _, n in seqs if n == 1)
    dev = DEVICE
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, device=dev),
        block_tables=torch.tensor([tb + [0] * (width - len(tb)) for tb in tables], dtype=torch.int32, device=dev),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
        num_decodes=nd, seq_lens_cpu=lens, query_start_loc_cpu=starts, max_decode_seq_len=max(lens[:nd], default=0))
    return q.to(dev), k.to(dev), v.to(dev), kv.to(dev), meta, torch.tensor(positions, device=dev)


def run(backend, q, k, v, kv, meta, positions, scale):
    """One layer's attention as the model runs it: store (RoPE + KV write), then attend."""
    rotary = RotaryEmbedding(q.shape[-1], 512, 10000.0).to(q.device)
    return backend.attend(backend.store(positions, q, k, v, rotary, kv, meta), kv, meta, scale)


CASES = [  # (heads, kv_heads, head_dim, block_size, seqs)
    (4, 2, 16, 16, [(0, 1), (5, 1), (40, 1), (0, 7), (17, 20)]),
    (14, 2, 64, 16, [(130, 1), (3, 1), (0, 70), (33, 5)]),  # group of 7: padded to 8
    (8, 8, 32, 8, [(64, 1), (0, 33), (9, 30)]),  # no grouping, page of 8
    (4, 1, 128, 16, [(200, 1), (1, 1), (16, 1), (15, 1), (0, 1)]),  # decode only, multi-query
]


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_matches_torch(case, dtype):
    if DEVICE.type == "cpu" and dtype == torch.float16:
        pytest.skip("float16 dot products are a GPU matter")
    heads, kv_heads, dim, bs, seqs = CASES[case]
    q, k, v, kv, meta, pos = make_step(seqs, heads, kv_heads, dim, bs, dtype, seed=case)
    scale = dim ** -0.5
    kv_ref = kv.float().clone()
    ref = run(TorchAttentionBackend(), q.float(), k.float(), v.float(), kv_ref, meta, pos, scale)
    backend = triton_backend.TritonAttentionBackend(heads, kv_heads, dim, DEVICE)
    backend.prepare(meta)
    out = run(backend, q, k, v, kv, meta, pos, scale).float()
    # the reference rotates k in float32; the kernel rounds it to the cache dtype
    tol = 1e-6 if dtype == torch.float32 else 1e-3
    torch.testing.assert_close(kv.float(), kv_ref, rtol=tol, atol=tol, msg="KV-cache write differs")
    err = (out - ref).norm() / ref.norm()
    assert err < (1e-5 if dtype == torch.float32 else 2e-3), f"relative error {err:.2e}"
    assert torch.isfinite(out).all()


def test_library_prefill_matches_torch(monkeypatch):
    """prefill_attention="cudnn": the long prefill seqs (a whole prompt, chunks after cached keys)
    through cuDNN on CUDA in bf16 (torch's CPU flash op on CPU, float32), the short ones and the
    decodes through the Triton kernel, in one step."""
    from expresslane.attention import library_prefill

    monkeypatch.setattr(triton_backend.TritonAttentionBackend, "LIBRARY_MIN_TOKENS", 16)
    # small buckets: the chunks after 100 and 400 cached keys take both calls and the merge
    monkeypatch.setattr(library_prefill, "Q_BUCKET", 16)
    monkeypatch.setattr(library_prefill, "KEY_BUCKET", 64)
    dtype = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
    heads, kv_heads, dim, bs = 8, 2, 128, 16
    seqs = [(300, 1), (7, 1), (0, 40), (100, 30), (5, 3), (400, 17)]
    q, k, v, kv, meta, pos = make_step(seqs, heads, kv_heads, dim, bs, dtype, seed=11)
    scale = dim ** -0.5
    ref = run(TorchAttentionBackend(), q.float(), k.float(), v.float(), kv.float().clone(), meta, pos, scale)
    backend = triton_backend.TritonAttentionBackend(heads, kv_heads, dim, DEVICE, kv_dtype=dtype,
                                                    prefill_library="cudnn")
    backend.prepare(meta)
    assert meta.library_seqs == (2, 3, 5)
    out = run(backend, q, k, v, kv, meta, pos, scale).float()
    err = (out - ref).norm() / ref.norm()
    assert err < (1e-5 if dtype == torch.float32 else 1e-2), f"relative error {err:.2e}"


def test_every_output_element_written():
    heads, kv_heads, dim, bs, seqs = CASES[1]
    q, k, v, kv, meta, pos = make_step(seqs, heads, kv_heads, dim, bs, torch.float32, seed=9)
    backend = triton_backend.TritonAttentionBackend(heads, kv_heads, dim, DEVICE)
    backend.prepare(meta)
    real_empty, real_alloc = torch.empty_like, torch.empty
    try:  # poison the output buffer the backend allocates
        torch.empty_like = lambda x, **kw: real_empty(x, **kw).fill_(float("nan"))
        torch.empty = lambda *a, **kw: real_alloc(*a, **kw).fill_(float("nan"))
        out = run(backend, q, k, v, kv, meta, pos, dim ** -0.5)
    finally:
        torch.empty_like, torch.empty = real_empty, real_alloc
    assert torch.isfinite(out).all()


def test_padding_rows_of_a_prefill_work_list_change_nothing():
    """A captured launch's work list ends in padding rows (seq -1) up to its bucket's largest:
    the output is bit for bit the same with them (their programs return before any work; that
    they are cheap is the GPU benchmark's to show, docs/performance.md session 13)."""
    heads, kv_heads, dim, bs, seqs = CASES[0]
    q, k, v, kv, meta, pos = make_step(seqs, heads, kv_heads, dim, bs, torch.float32, seed=3)
    backend = triton_backend.TritonAttentionBackend(heads, kv_heads, dim, DEVICE)
    backend.prepare(meta)
    exact = run(backend, q, k, v, kv.clone(), meta, pos, dim ** -0.5)
    padding = torch.tensor([[-1, 0, 0, 1, 0]] * 40, dtype=torch.int32, device=DEVICE)
    meta.prefill_work = torch.cat([meta.prefill_work, padding])
    padded = run(backend, q, k, v, kv.clone(), meta, pos, dim ** -0.5)
    torch.testing.assert_close(padded, exact, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_folds_the_qk_norm(dtype):
    """Qwen3's per-head q_norm / k_norm inside the RoPE + KV-write kernel equal the RMSNorm
    modules applied first (torch backend), on q and on the cache; bf16 bit for bit up to the
    order of the variance sum."""
    from expresslane.layers.norm import RMSNorm

    if DEVICE.type == "cpu" and dtype == torch.bfloat16:
        pytest.skip("bfloat16 is a GPU matter here")
    heads, kv_heads, dim, bs, seqs = CASES[1]
    q, k, v, kv, meta, pos = make_step(seqs, heads, kv_heads, dim, bs, dtype, seed=4)
    g = torch.Generator().manual_seed(5)
    norms = []
    for fused in (False, True):
        qn, kn = RMSNorm(dim, 1e-6, fused), RMSNorm(dim, 1e-6, fused)
        qn.weight.data, kn.weight.data = (torch.rand(dim, generator=g) + 0.5 for _ in range(2))
        norms.append((qn.to(DEVICE, dtype), kn.to(DEVICE, dtype)))
    norms[1][0].weight.data, norms[1][1].weight.data = norms[0][0].weight.data, norms[0][1].weight.data
    rotary = RotaryEmbedding(dim, 512, 10000.0).to(DEVICE)
    kv_ref = kv.clone()
    q_ref = TorchAttentionBackend().store(pos, q, k, v, rotary, kv_ref, meta, qk_norm=norms[0])
    backend = triton_backend.TritonAttentionBackend(heads, kv_heads, dim, DEVICE)
    q_out = backend.store(pos, q, k, v, rotary, kv, meta, qk_norm=norms[1])
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(q_out.float(), q_ref.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(kv.float(), kv_ref.float(), rtol=tol, atol=tol)
    plain = backend.store(pos, q, k, v, rotary, kv.clone(), meta)  # without the norms: another q
    assert not torch.allclose(plain.float(), q_out.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("kind", ["longrope", "dynamic"])
def test_store_rotates_partial_heads_by_rope_length(kind):
    """The RoPE + KV-write kernel with RoPE that follows each request's length (its rows from
    `rotary.lookup`) and partial rotary (48 of 64 dims; the rest copied as is) equals the torch
    backend, on q and on the cache; the lengths change the result."""
    from expresslane.layers.rotary import RopeFrequencies, default_inv_freq

    heads, kv_heads, dim, bs, seqs = CASES[1]
    q, k, v, kv, meta, pos = make_step(seqs, heads, kv_heads, dim, bs, torch.float32, seed=6)
    short = default_inv_freq(10000.0, 48)
    longer = short / 4 if kind == "longrope" else torch.stack([short / (1 + i / 100) for i in range(512 - 64)])
    rotary = RotaryEmbedding(dim, 512, freqs=RopeFrequencies(kind, short, 1.2, 64, longer)).to(DEVICE)
    # per seq: a short class (20), prompts past the threshold (100, 70), a decode past it (position 130)
    lengths = [20, 100, 70, 30]
    meta.rope_lengths = torch.tensor([n for (_, m), n in zip(seqs, lengths) for _ in range(m)], device=DEVICE)
    kv_ref = kv.clone()
    q_ref = TorchAttentionBackend().store(pos, q, k, v, rotary, kv_ref, meta)
    backend = triton_backend.TritonAttentionBackend(heads, kv_heads, dim, DEVICE)
    q_out = backend.store(pos, q, k, v, rotary, kv, meta)
    torch.testing.assert_close(q_out, q_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(kv, kv_ref, rtol=1e-6, atol=1e-6)
    assert torch.equal(q_out[..., 48:], q[..., 48:])
    meta.rope_lengths = torch.ones_like(meta.rope_lengths)
    assert not torch.allclose(backend.store(pos, q, k, v, rotary, kv.clone(), meta), q_out, atol=1e-3)
