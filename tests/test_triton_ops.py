"""Fused Triton elementwise kernels against the torch path (interpreter on CPU)."""

import pytest
import torch

triton_ops = pytest.importorskip("expresslane.layers.triton_ops")

from expresslane.layers.norm import RMSNorm  # noqa: E402

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
@pytest.mark.parametrize("parts", [2, 8])
def test_rms_norm_sums_a_rows_parts_first(dtype, parts):
    """The fused MoE hands the next norm each token's k expert rows: summed in the kernel (float32,
    one rounding, as torch's sum), then as with one row."""
    g = torch.Generator().manual_seed(parts)
    hidden = 96
    x = (torch.randn(5, parts, hidden, generator=g) / parts).to(dtype)
    r = torch.randn(5, hidden, generator=g).to(dtype)
    w = torch.randn(hidden, generator=g).to(dtype).to(DEVICE)
    out, res = triton_ops.rms_norm(x.to(DEVICE), w, 1e-6, residual=r.to(DEVICE))
    ref_out, ref_res = triton_ops.rms_norm(x.sum(1).to(DEVICE), w, 1e-6, residual=r.to(DEVICE))
    assert out.shape == res.shape == r.shape
    # one summation order against another: float32 sums may differ in their last bit
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert torch.allclose(res.float(), ref_res.float(), atol=tol) and torch.allclose(out.float(), ref_out.float(), atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemma_post_norm_joins_the_next_norms_pass(dtype):
    """Gemma's post-attention norm of the sublayer output, the residual add and the pre-MLP norm
    in one pass equal the three steps of GemmaRMSNorm's torch path (bf16: each rounding in place)."""
    from expresslane.models.gemma import GemmaRMSNorm

    g = torch.Generator().manual_seed(3)
    hidden = 96
    post, pre_mlp = GemmaRMSNorm(hidden, 1e-6), GemmaRMSNorm(hidden, 1e-6)
    for norm in (post, pre_mlp):
        norm.weight.data = torch.randn(hidden, generator=g).to(dtype)
    x = (4 * torch.randn(6, hidden, generator=g)).to(dtype)
    r = torch.randn(6, hidden, generator=g).to(dtype)
    out, res = triton_ops.rms_norm(x.to(DEVICE), pre_mlp.weight.data.to(DEVICE), 1e-6, r.to(DEVICE), offset=True,
                                   pre_weight=post.weight.data.to(DEVICE))
    ref_out, ref_res = pre_mlp(x, r, pre=post)  # unfused: post(x), then the add and the norm
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # the post-norm's variance sums in another order
    assert torch.allclose(res.cpu().float(), ref_res.float(), atol=tol)
    assert torch.allclose(out.cpu().float(), ref_out.float(), atol=tol)
    with pytest.raises(ValueError, match="pre_weight"):
        triton_ops.rms_norm(x.to(DEVICE), pre_mlp.weight.data.to(DEVICE), 1e-6, pre_weight=post.weight.data)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    x = torch.randn(5, 2 * 300, generator=torch.Generator().manual_seed(0)).to(dtype)
    gate, up = x.float().chunk(2, dim=-1)
    ref = (torch.nn.functional.silu(gate.to(dtype)) * up.to(dtype)).float()
    out = triton_ops.silu_and_mul(x.to(DEVICE)).cpu().float()
    assert torch.allclose(out, ref, atol=1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("backend_name", ["torch", "triton"])
def test_model_shares_one_rope_table_and_fuses_by_backend(llama_dir, backend_name):
    """One cos/sin table per model; the fused RMSNorm/SiLU follow the attention backend,
    not the device (`--attention-backend torch` on a GPU runs torch ops)."""
    from expresslane.attention.registry import get_backend
    from expresslane.layers.norm import RMSNorm
    from expresslane.models.model_dir import load_hf_config
    from expresslane.models.registry import model_class

    cfg = load_hf_config(llama_dir)
    backend = get_backend(backend_name, cfg.num_attention_heads, cfg.num_key_value_heads, 16, DEVICE)
    model = model_class(cfg)(cfg, backend)
    tables = {layer.self_attn.rotary.cos_sin.data_ptr() for layer in model.layers}
    assert tables == {model.rotary.cos_sin.data_ptr()}
    fused = backend_name == "triton"
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    assert norms and all(m.fused == fused for m in norms)
    assert all(layer.mlp.fused == fused for layer in model.layers)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemma_rms_norm_and_gelu_and_mul(dtype):
    """Gemma's (1 + w) norm (alone, and with the residual add) and GeGLU against their torch paths;
    the gelu's argument spans its tails (tanh at +-1)."""
    from expresslane.layers.activation import gelu_and_mul
    from expresslane.models.gemma import GemmaRMSNorm

    g = torch.Generator().manual_seed(3)
    hidden = 96
    norm = GemmaRMSNorm(hidden, 1e-6).to(dtype)
    norm.weight.data = torch.randn(hidden, generator=g).to(dtype)
    fused = GemmaRMSNorm(hidden, 1e-6, fused=True).to(dtype).to(DEVICE)
    fused.weight.data = norm.weight.data.to(DEVICE)
    x, r = (torch.randn(7, hidden, generator=g).to(dtype) for _ in range(2))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(fused(x.to(DEVICE)).cpu().float(), norm(x).float(), atol=tol)
    out, res = fused(x.to(DEVICE), r.to(DEVICE))
    ref_out, ref_res = norm(x, r)
    assert torch.equal(res.cpu(), ref_res) and torch.allclose(out.cpu().float(), ref_out.float(), atol=tol)
    gate_up = (torch.randn(5, 2 * 300, generator=g) * 6).to(dtype)
    out = gelu_and_mul(gate_up.to(DEVICE), fused=True).cpu().float()
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: a last-bit tanh difference may round the other way
    assert torch.allclose(out, gelu_and_mul(gate_up).float(), rtol=tol, atol=tol)
