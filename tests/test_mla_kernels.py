"""The MLA Triton kernels (latent-cache write, latent attention) against the torch reference
(attention/mla.py), on random inputs: on CPU through Triton's interpreter."""

import random

import pytest
import torch

from expresslane.attention.backend import AttentionMetadata
from expresslane.attention.mla import TorchMLA, expanded_prefill, latent_attention

mla_kernels = pytest.importorskip("expresslane.attention.mla_kernels")


def make_step(seqs, block_size, seed):
    """seqs: (cached, new) each, decodes (new 1) first -> (meta, slots, positions, num_blocks)."""
    rng = random.Random(seed)
    per_seq = [-(-(c + n) // block_size) for c, n in seqs]
    ids = list(range(sum(per_seq) + 2))
    rng.shuffle(ids)  # a seq's blocks scattered, as in a real cache
    tables, slots, positions, starts = [], [], [], [0]
    for (c, n), nb in zip(seqs, per_seq):
        table = [ids.pop() for _ in range(nb)]
        tables.append(table + [0] * (max(per_seq) - nb))
        slots += [table[p // block_size] * block_size + p % block_size for p in range(c, c + n)]
        positions += range(c, c + n)
        starts.append(starts[-1] + n)
    lens = [c + n for c, n in seqs]
    nd = sum(1 for _, n in seqs if n == 1)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), block_tables=torch.tensor(tables, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32), query_start_loc=torch.tensor(starts, dtype=torch.int32),
        num_decodes=nd, seq_lens_cpu=lens, query_start_loc_cpu=starts, max_decode_seq_len=max(lens[:nd], default=0))
    return meta, torch.tensor(positions), len(ids) + sum(per_seq)


# decodes of several lengths, then prefill chunks after a cached prefix and from scratch; decode-only
# steps of few tokens split their keys (one token: 8 splits on the CPU's nominal 4 SMs; three: 3, a
# context of one key leaving splits empty)
STEPS = [[(0, 1), (5, 1), (40, 1), (0, 9), (17, 20)], [(70, 1)], [(3, 1), (100, 1), (0, 1)], [(0, 33), (3, 5)]]


@pytest.mark.parametrize("seqs", STEPS)
@pytest.mark.parametrize("heads,lat,rope", [(4, 32, 8), (20, 24, 16)])  # a second head tile; L not a power of 2
def test_latent_attention_matches_reference(seqs, heads, lat, rope):
    g = torch.Generator().manual_seed(len(seqs) + heads)
    block_size = 16
    meta, positions, num_blocks = make_step(seqs, block_size, seed=heads)
    t = meta.query_start_loc_cpu[-1]
    cache = torch.randn(num_blocks, block_size, lat + rope, generator=g)
    q_lat, q_pe = torch.randn(t, heads, lat, generator=g), torch.randn(t, heads, rope, generator=g)
    want = latent_attention(q_lat, q_pe, cache, meta, 0.3)
    got = mla_kernels.paged_latent_attention(q_lat, q_pe, cache, positions, meta, 0.3)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_real_shapes_in_half_precision():
    """DeepSeek's own dims (L 512, R 64, 16 heads a rank) in float16 (the interpreter's bfloat16 is not
    exact), one decode split over its keys and a prefill chunk."""
    g = torch.Generator().manual_seed(5)
    meta, positions, num_blocks = make_step([(300, 1), (40, 6)], 16, seed=5)
    cache = torch.randn(num_blocks, 16, 576, generator=g).half()
    q_lat, q_pe = torch.randn(7, 16, 512, generator=g).half(), torch.randn(7, 16, 64, generator=g).half()
    want = latent_attention(q_lat.float(), q_pe.float(), cache.float(), meta, 0.04)
    got = mla_kernels.paged_latent_attention(q_lat, q_pe, cache, positions, meta, 0.04)
    torch.testing.assert_close(got.float(), want, atol=2e-3, rtol=2e-3)


def test_padding_tokens_read_nothing():
    """A CUDA graph's padding: tokens past the last seq, and a seq of length 0, give zeros."""
    meta, positions, num_blocks = make_step([(3, 1), (0, 4)], 16, seed=1)
    meta.query_start_loc = torch.tensor([0, 1, 5, 5], dtype=torch.int32)  # seq 2: the padding seq, no tokens
    meta.seq_lens = torch.tensor([4, 4, 0], dtype=torch.int32)
    meta.block_tables = torch.cat([meta.block_tables, torch.zeros(1, meta.block_tables.shape[1], dtype=torch.int32)])
    cache = torch.randn(num_blocks, 16, 40)
    q_lat, q_pe = torch.randn(8, 4, 32), torch.randn(8, 4, 8)
    positions = torch.cat([positions, torch.zeros(3, dtype=torch.int64)])
    got = mla_kernels.paged_latent_attention(q_lat, q_pe, cache, positions, meta, 0.5)
    assert got[5:].abs().max() == 0
    assert got[:5].abs().min() > 0


def test_rope_store_matches_reference_and_skips_padding():
    """The fused latent write (c_kv's RMSNorm, RoPE on k_pe and q_pe, the cache slot) equals the
    torch path's norm, rotary and copy (float32: the rotations bit for bit, the norm to an ulp of
    rsqrt); a padding token's slot stays unwritten. Strided inputs, as the projections' splits give
    them; YaRN's scaled table. (bf16: on CUDA, through the DeepSeek models' tests; the interpreter
    rounds to bf16 its own way.)"""
    dtype = torch.float32
    from transformers import Qwen2Config

    from expresslane.layers.norm import RMSNorm
    from expresslane.layers.rotary import RotaryEmbedding, rope_frequencies

    g = torch.Generator().manual_seed(4)
    heads, lat, rope, nope = 3, 24, 8, 6
    meta, positions, num_blocks = make_step([(2, 1), (5, 1), (0, 6)], 4, seed=2)
    meta.slot_mapping[4] = -1  # a padding token: written nowhere
    t = positions.shape[0]
    cfg = Qwen2Config(max_position_embeddings=64, hidden_size=2 * rope, num_attention_heads=2,
                      rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16})
    rotary = RotaryEmbedding(rope, 64, freqs=rope_frequencies(cfg, rope, 64))
    norm = RMSNorm(lat, 1e-6)
    norm.weight.data = (torch.randn(lat, generator=g) * 0.5 + 1).to(dtype)
    kv = (torch.randn(t, lat + rope, generator=g) * 3).to(dtype)
    q = torch.randn(t, heads, nope + rope, generator=g).to(dtype)
    c_kv, k_pe = kv.split([lat, rope], dim=-1)
    q_pe = q[..., nope:]
    want = torch.zeros(num_blocks, 4, lat + rope, dtype=dtype)
    got = torch.zeros_like(want)
    q_want = TorchMLA().rope_store(want, q_pe, c_kv, k_pe, norm, rotary, positions, meta)
    q_got = mla_kernels.rope_store_latent(got, q_pe, c_kv, k_pe, norm, rotary, positions, meta)
    assert torch.equal(q_got, q_want) and q_got.is_contiguous()
    assert torch.equal(got[..., lat:], want[..., lat:])
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    written = want.view(-1, lat + rope)[meta.slot_mapping[meta.slot_mapping >= 0]]
    assert written.abs().sum(-1).min() > 0 and want.view(-1, lat + rope).abs().sum(-1).count_nonzero() == t - 1


def test_expanded_prefill_equals_absorbed():
    """Prefill may expand: the same attention as the latent path, given W_UK and W_UV."""
    g = torch.Generator().manual_seed(3)
    heads, lat, rope, nope, v_dim = 3, 16, 8, 12, 10
    meta, _, num_blocks = make_step([(9, 1), (0, 7), (20, 5)], 8, seed=3)
    t = meta.query_start_loc_cpu[-1]
    cache = torch.randn(num_blocks, 8, lat + rope, generator=g, dtype=torch.float64)
    w_uk = torch.randn(heads, nope, lat, generator=g, dtype=torch.float64)
    w_uv = torch.randn(heads, v_dim, lat, generator=g, dtype=torch.float64)
    q_nope = torch.randn(t, heads, nope, generator=g, dtype=torch.float64)
    q_pe = torch.randn(t, heads, rope, generator=g, dtype=torch.float64)
    absorbed = torch.einsum("thl,hvl->thv", latent_attention(torch.einsum("thn,hnl->thl", q_nope, w_uk), q_pe,
                                                             cache, meta, 0.2), w_uv)
    expand = lambda c: (torch.einsum("cl,hnl->chn", c, w_uk), torch.einsum("cl,hvl->chv", c, w_uv))  # noqa: E731
    expanded = expanded_prefill(q_nope, q_pe, cache, meta, 0.2, expand, v_dim)
    torch.testing.assert_close(expanded, absorbed[meta.num_decodes:])


def test_unfilled_seq_slots_of_a_graph_change_no_real_token():
    """A mixed graph's meta has more seq slots than the step fills; the rest hold old values."""
    meta, positions, num_blocks = make_step([(3, 1), (0, 4), (20, 6)], 16, seed=4)
    cache, q_lat, q_pe = torch.randn(num_blocks, 16, 40), torch.randn(11, 4, 32), torch.randn(11, 4, 8)
    want = latent_attention(q_lat, q_pe, cache, meta, 0.5)
    meta.query_start_loc = torch.tensor([0, 1, 5, 11, 11, 2, 3], dtype=torch.int32)  # padding seq, then stale
    meta.seq_lens = torch.tensor([4, 4, 26, 0, 7, 9], dtype=torch.int32)
    meta.block_tables = torch.cat([meta.block_tables, meta.block_tables[:3]])
    got = mla_kernels.paged_latent_attention(q_lat, q_pe, cache, positions, meta, 0.5)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
