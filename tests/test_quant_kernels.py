"""The quantized-linear Triton kernels (Triton's interpreter on CPU) against float32
dequantize-then-matmul references, on fresh random inputs."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from expresslane.quant.fp8 import fp8_linear_reference, quantize_per_row  # noqa: E402
from expresslane.quant.int4 import dequantize, pack_rows, quantize_groups  # noqa: E402
from expresslane.quant.kernels import per_token_quant_fp8, quant_gemm  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROWS = [1, 5, 16, 17, 70]  # decode sizes (one tile of 16), a partial tile, a larger-tile path


def _inputs(m: int, k: int, n: int, seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(DEVICE, dtype)
    w = torch.randn(n, k, generator=g) * 0.05
    return x, w, (torch.randn(n, generator=g) * 0.1).to(DEVICE, dtype)


def test_per_token_quant_equals_the_reference():
    x = torch.randn(37, 200, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    x[3] = 0  # an all-zero row: scale floor, zeros out
    q, s = per_token_quant_fp8(x)
    q_ref, s_ref = quantize_per_row(x)
    assert torch.equal(s[:, 0].cpu(), s_ref.cpu())
    assert torch.equal(q.view(torch.uint8).cpu(), q_ref.view(torch.uint8).cpu())


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("bias", [False, True])
def test_fp8_gemm_matches_reference(m, bias):
    x, w, b = _inputs(m, 192, 96, seed=m)
    wq, ws = quantize_per_row(w)
    wq, ws = wq.to(DEVICE), ws.to(DEVICE)
    got = quant_gemm(x, wq, ws, None, b if bias else None, 96, None)
    want = fp8_linear_reference(x, wq, ws, b if bias else None)
    # float32 throughout, the same e4m3 operands (the kernel quantizes x exactly as the reference
    # does): only the summation order differs, within K float32 roundings of the sum of
    # |products| (|x_q| <= 1.07 |x|: one e4m3 rounding, hence the factor 2)
    bound = (x.abs() @ (wq.float().abs() * ws[:, None]).t()) * 2 * 192 * 2**-24 + 1e-6
    assert ((got - want).abs() <= bound).all()


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_gemm_matches_reference(m, group):
    k, n = 256, 80
    x, w, b = _inputs(m, k, n, seed=100 + m)
    q, z, s = quantize_groups(w, group, sym=False)
    qweight, zeros, scales = pack_rows(q).to(DEVICE), z.to(DEVICE, torch.uint8), s.half().to(DEVICE)
    got = quant_gemm(x, qweight, scales, zeros, b, n, group)
    want = x @ dequantize(qweight, zeros, scales, group) + b
    # float32 operands (w = (q - z) * s exactly: small integers times an fp16 scale), float32
    # sums in another order: within K float32 roundings of the sum of |products|
    bound = (x.abs() @ dequantize(qweight, zeros, scales, group).abs()) * k * 2**-24 + 1e-6
    assert ((got - want).abs() <= bound).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_int4_gemm_half_precision(dtype):
    if DEVICE == "cpu":
        pytest.skip("16-bit dot products are a GPU matter (the interpreter has no bfloat16)")
    """16-bit activations: the kernel rounds each dequantized weight to the activation dtype
    (relative error <= 2^-8 for bf16, 2^-11 for fp16) and accumulates in float32; the output is
    rounded once more. Against float32 on the same (rounded) inputs."""
    k, n, group = 256, 64, 128
    x, w, _ = _inputs(9, k, n, seed=7, dtype=dtype)
    q, z, s = quantize_groups(w, group, sym=True)
    qweight, zeros, scales = pack_rows(q).to(DEVICE), z.to(DEVICE, torch.uint8), s.half().to(DEVICE)
    got = quant_gemm(x, qweight, scales, zeros, None, n, group).float()
    wf = dequantize(qweight, zeros, scales, group)
    want = x.float() @ wf
    eps = 2**-8 if dtype == torch.bfloat16 else 2**-11
    bound = (x.float().abs() @ wf.abs()) * eps + want.abs() * eps + 1e-4
    assert ((got - want).abs() <= bound).all()


@pytest.mark.parametrize("m", [1, 16, 300])
def test_fp8_linear_bf16_on_gpu(m):
    """The CUDA paths of Fp8Method (fused Triton kernel up to 16 rows, per-token quantization +
    torch._scaled_mm above) against the float32 reference: both use the same e4m3 operands and
    float32 accumulation; the bf16 output rounding (2^-8 relative) is the difference."""
    if DEVICE == "cpu":
        pytest.skip("needs CUDA (torch._scaled_mm)")
    from torch import nn

    from expresslane.quant.fp8 import Fp8Method
    from expresslane.quant.linear import QuantLinear

    x, w, _ = _inputs(m, 512, 256, seed=3, dtype=torch.bfloat16)
    with torch.device(DEVICE):
        layer = QuantLinear(512, [256], False, Fp8Method(serialized=False))
    layer.load_part(0, "weight", w.to(DEVICE, torch.bfloat16))
    got = layer(x).float()
    want = fp8_linear_reference(x.float(), layer.weight, layer.weight_scale, None)
    bound = want.abs() * 2**-7 + (x.float().abs() @ layer.dequantized_weight().abs().t()) * 2**-12
    assert isinstance(layer, nn.Module) and ((got - want).abs() <= bound).all()
