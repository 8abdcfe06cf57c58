"""Fused Triton elementwise kernels against the torch path (interpreter on CPU)."""

import pytest
import torch

triton_ops = pytest.importorskip("expresslane.layers.triton_ops")

from expresslane.layers.norm import RMSNorm  # noqa: E402
from expresslane.layers.rotary import RotaryEmbedding  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 96, 896])
def test_rms_norm(dtype, hidden):
    g = torch.Generator().manual_seed(hidden)
    norm = RMSNorm(hidden, 1e-6)
    norm.weight.data = torch.randn(hidden, generator=g)
    x = torch.randn(7, hidden, generator=g).to(dtype)
    r = torch.randn(7, hidden, generator=g).to(dtype)
    w = norm.weight.data.to(dtype).to(DEVICE)
    ref_norm = RMSNorm(hidden, 1e-6).to(dtype)
    ref_norm.weight.data = norm.weight.data.to(dtype)
    out = triton_ops.rms_norm(x.to(DEVICE), w, 1e-6)
    assert torch.allclose(out.cpu().float(), ref_norm._norm(x).float(), atol=1e-5 if dtype == torch.float32 else 2e-2)
    out, res = triton_ops.rms_norm(x.to(DEVICE), w, 1e-6, residual=r.to(DEVICE))
    ref_out, ref_res = ref_norm._norm(x + r), x + r
    assert torch.equal(res.cpu(), ref_res)
    assert torch.allclose(out.cpu().float(), ref_out.float(), atol=1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    x = torch.randn(5, 2 * 300, generator=torch.Generator().manual_seed(0)).to(dtype)
    gate, up = x.float().chunk(2, dim=-1)
    ref = (torch.nn.functional.silu(gate.to(dtype)) * up.to(dtype)).float()
    out = triton_ops.silu_and_mul(x.to(DEVICE)).cpu().float()
    assert torch.allclose(out, ref, atol=1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("heads, dim", [(4, 16), (14, 64), (3, 128)])
def test_rotary(heads, dim):
    g = torch.Generator().manual_seed(dim)
    rope = RotaryEmbedding(dim, 256, 10000.0)
    qkv = torch.randn(9, (heads + 2) * dim, generator=g)  # q is a strided view, as in the model
    q = qkv[:, :heads * dim].view(9, heads, dim)
    k = qkv[:, heads * dim:(heads + 1) * dim].view(9, 1, dim)
    pos = torch.randint(0, 256, (9,), generator=g)
    ref_q, ref_k = rope(pos, q, k)
    cs = rope.cos_sin.to(DEVICE)
    out_q = triton_ops.rotary(q.to(DEVICE) if DEVICE.type == "cuda" else q, pos.to(DEVICE), cs)
    out_k = triton_ops.rotary(k.to(DEVICE) if DEVICE.type == "cuda" else k, pos.to(DEVICE), cs)
    assert torch.allclose(out_q.cpu(), ref_q, atol=1e-6) and torch.allclose(out_k.cpu(), ref_k, atol=1e-6)
