"""Attention sinks (gpt-oss): a learned logit per query head joins the softmax's denominator.
The torch backend and the Triton kernels (through the interpreter on CPU) against an exact
float64 reference, with and without a sliding window, over decodes, prefill chunks after a
cached prefix, decode splits and split prefill items (the sink counted once over the splits)."""

import pytest
import torch
from models import exact_attention
from test_sliding_window import WINDOW_CASES, _variant
from test_triton_attention import DEVICE, make_step

from expresslane.attention.torch_backend import TorchAttentionBackend
from expresslane.layers.rotary import RotaryEmbedding

BLOCK = 16


def sink_step(heads, kv_heads, dim, window, seqs, seed, sinks):
    """Rotated q and the written cache of a step, the exact output; then, windowed, every block
    wholly before its seq's first window filled with NaN (a freed block may hold anything)."""
    q, k, v, kv, meta, pos = make_step(seqs, heads, kv_heads, dim, BLOCK, torch.float32, seed)
    q = TorchAttentionBackend().store(pos, q, k, v, RotaryEmbedding(dim, 1024, 10000.0).to(q.device), kv, meta)
    exact = exact_attention(q, kv, meta, dim ** -0.5, window, sinks)
    for i, (cached, _) in enumerate(seqs if window else ()):
        first = max(0, cached - window + 1) // BLOCK
        kv[:, meta.block_tables[i, :first].long()] = float("nan")
    return q, kv, meta, exact


@pytest.mark.parametrize("windowed", [True, False])
@pytest.mark.parametrize("variant", ["default", "small-split"])
@pytest.mark.parametrize("case", range(len(WINDOW_CASES)))
def test_sinks_match_the_exact_attention(case, variant, windowed):
    triton_backend = pytest.importorskip("expresslane.attention.triton_backend")
    heads, kv_heads, dim, window, seqs = WINDOW_CASES[case]
    window_arg = window if windowed else None
    # sinks from far below the scores (no effect) to far above them (most weight on the sink)
    sinks = torch.linspace(-6.0, 6.0, heads, device=DEVICE)
    q, kv, meta, exact = sink_step(heads, kv_heads, dim, window_arg, seqs, case, sinks)
    scale = dim ** -0.5
    ref = TorchAttentionBackend().attend(q, kv, meta, scale, window=window_arg, sinks=sinks)
    torch.testing.assert_close(ref, exact, rtol=1e-5, atol=1e-5)
    without = TorchAttentionBackend().attend(q, kv, meta, scale, window=window_arg)
    assert (without - ref).abs().max() > 0.1  # the sinks changed the result
    args, attributes = _variant(variant, window_arg)
    backend = triton_backend.TritonAttentionBackend(heads, kv_heads, dim, DEVICE, **args)
    for name, value in attributes.items():
        setattr(backend, name, value)
    backend.prepare(meta)
    if variant == "small-split":
        assert meta.num_splits > 1 and meta.prefill_work[:, 3].max() > 1
    out = backend.attend(q, kv, meta, scale, window=window_arg, sinks=sinks)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, exact, rtol=1e-5, atol=1e-5)


def test_sinks_with_fused_split_reduction():
    """Decode splits combined by the last split to arrive (FUSED_REDUCE), not the reduction kernel."""
    triton_backend = pytest.importorskip("expresslane.attention.triton_backend")
    from expresslane.attention.triton_tiles import DecodeTile

    heads, kv_heads, dim = 8, 2, 32
    seqs = [(200, 1), (5, 1), (64, 1)]
    sinks = torch.linspace(-3.0, 3.0, heads, device=DEVICE)
    q, kv, meta, exact = sink_step(heads, kv_heads, dim, None, seqs, 11, sinks)
    tiles = {32: ((1, DecodeTile(max_splits=4, waves=64, block_n=16, fused_reduce=True)),)}
    backend = triton_backend.TritonAttentionBackend(heads, kv_heads, dim, DEVICE, decode_tiles=tiles)
    backend.sms = 1024
    backend.prepare(meta)
    assert meta.num_splits > 1 and meta.decode_tile.fused_reduce
    out = backend.attend(q, kv, meta, dim ** -0.5, sinks=sinks)
    torch.testing.assert_close(out, exact, rtol=1e-5, atol=1e-5)
