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


@pytest.mark.parametrize("producer", ["rms_norm", "rms_norm_residual", "silu_and_mul"])
def test_fused_producer_quantizes_like_per_token_quant(producer):
    """The fused RMSNorm / SiLU-and-mul kernels, asked for an FP8 consumer's input, write the
    very e4m3 bytes and scales per_token_quant_fp8 makes of the row they store (bit for bit:
    the model's tokens do not change with the fold), and the row itself as without fp8_out.
    Rows: a decode batch with an all-zero row (the scale floor); SiLU-and-mul past FP8_ROWS
    stays plain (its consumer quantizes)."""
    from expresslane.layers import triton_ops
    from expresslane.quant.fp8 import Fp8Activation

    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32  # (the interpreter has no bfloat16)
    g = torch.Generator().manual_seed(11)
    rows, n = 5, 200
    if producer == "silu_and_mul":
        x = (torch.randn(rows, 2 * n, generator=g) * 3).to(DEVICE, dtype)
        x[2] = 0
        got, plain = triton_ops.silu_and_mul(x, fp8_out=True), triton_ops.silu_and_mul(x)
        long = torch.zeros(triton_ops.FP8_ROWS + 1, 2 * n, device=DEVICE, dtype=dtype)
        assert not isinstance(triton_ops.silu_and_mul(long, fp8_out=True), Fp8Activation)
    else:
        x = (torch.randn(rows, n, generator=g) * 3).to(DEVICE, dtype)
        w = torch.randn(n, generator=g).to(DEVICE, dtype)
        res = torch.randn(rows, n, generator=g).to(DEVICE, dtype) if producer == "rms_norm_residual" else None
        x[2] = 0
        if res is not None:
            res[2] = 0
        got, plain = triton_ops.rms_norm(x, w, 1e-6, res, fp8_out=True), triton_ops.rms_norm(x, w, 1e-6, res)
        if res is not None:
            assert torch.equal(got[1], plain[1])
            got, plain = got[0], plain[0]
    assert isinstance(got, Fp8Activation) and torch.equal(got.x, plain)
    q, s = per_token_quant_fp8(plain)
    assert got.q.dtype == torch.float8_e4m3fn and got.scale.shape == (rows, 1)
    assert torch.equal(got.q.view(torch.uint8).cpu(), q.view(torch.uint8).cpu())
    assert torch.equal(got.scale.cpu(), s.cpu()) and not got.q[2].float().any()


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


@pytest.mark.parametrize("m", [1, 5, 16, 300])
def test_fp8_linear_bf16_on_gpu(m):
    """The CUDA paths of Fp8Method (per-token quantization, then the GEMV up to 16 rows and
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


# --- decode GEMVs (quant/gemv.py): split-K over programs, the last of a tile reducing ---

GEMV_ROWS = [1, 3, 16]
SPLITS = [1, 3, None]  # one program per tile, an uneven split, the default (as many as the K steps allow)


def _counters_clear():
    from expresslane.device import arrival_counters
    assert int(arrival_counters(torch.device(DEVICE)).abs().sum()) == 0  # every tile's last program reset its counter


@pytest.mark.parametrize("m", GEMV_ROWS)
@pytest.mark.parametrize("split", SPLITS)
def test_fp8_gemv_matches_reference(m, split):
    """x quantized per token first (per_token_quant_fp8): the same e4m3 operands as the
    reference, float32 sums in another order (per BLOCK_K step, scaled), the bound of
    test_fp8_gemm_matches_reference. N = 200 is not a multiple of the tile (masked edge tile).
    On a GPU the dot is an FP8 tensor-core MMA, whose running sums are short of float32: a
    step of 64 inputs keeps them within the bound."""
    from expresslane.quant.gemv import gemv

    k, n = 512, 200
    x, w, b = _inputs(m, k, n, seed=200 + m)
    wq, ws = quantize_per_row(w)
    wq, ws = wq.to(DEVICE), ws.to(DEVICE)
    want = fp8_linear_reference(x, wq, ws, b)
    bound = (x.abs() @ (wq.float().abs() * ws[:, None]).t()) * 2 * k * 2**-24 + 1e-6
    got = gemv(x, wq, ws, b, block_n=64, block_k=64, split=split)
    assert ((got - want).abs() <= bound).all()
    _counters_clear()


def test_fp8_gemv_takes_a_quantized_input():
    """x handed over with its quantization (xq, from a fused producer): the same output, bit for
    bit, as when the GEMV quantizes x itself."""
    from expresslane.quant.gemv import gemv

    x, w, b = _inputs(3, 256, 64, seed=250)
    wq, ws = quantize_per_row(w)
    wq, ws = wq.to(DEVICE), ws.to(DEVICE)
    want = gemv(x, wq, ws, b, block_n=64, block_k=64, split=2)
    got = gemv(x, wq, ws, b, xq=per_token_quant_fp8(x), block_n=64, block_k=64, split=2)
    assert torch.equal(got, want)
    _counters_clear()


@pytest.mark.parametrize("m", GEMV_ROWS)
def test_gemv_unquantized_matches_reference(m):
    """W in the activation dtype (the bf16 GEMV; float32 here, exact-precision dot)."""
    from expresslane.quant.gemv import gemv

    k, n = 384, 128
    x, w, b = _inputs(m, k, n, seed=300 + m)
    w = w.to(DEVICE)
    got = gemv(x, w, None, b, block_n=64, block_k=128, split=None)
    want = x @ w.t() + b
    bound = (x.abs() @ w.abs().t()) * k * 2**-24 + 1e-6
    assert ((got - want).abs() <= bound).all()
    _counters_clear()


@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("group", [32, 128, 256])
@pytest.mark.parametrize("split", SPLITS)
def test_int4_gemv_matches_reference(m, group, split):
    """Nibbles decoded through the float 2^23 + q 2^p (exact), (q - z) x summed per group in
    float32 and scaled once: within K float32 roundings of the sum of |products| of the
    dequantized reference. N = 80: a partial column tile (block 64)."""
    from expresslane.quant.gemv import int4_gemv

    k, n = 512, 80
    x, w, b = _inputs(m, k, n, seed=400 + m)
    q, z, s = quantize_groups(w, group, sym=False)
    qweight, zeros, scales = pack_rows(q).to(DEVICE), z.to(DEVICE, torch.uint8), s.half().to(DEVICE)
    wf = dequantize(qweight, zeros, scales, group)
    got = int4_gemv(x, qweight, scales, zeros, b, group, block_n=64, split=split)
    want = x @ wf + b
    bound = (x.abs() @ wf.abs()) * 2 * k * 2**-24 + 1e-6
    assert ((got - want).abs() <= bound).all()
    _counters_clear()


def test_int4_dequantize_is_exact():
    """The dense weight of the long-input path: (q - z) * s in float32, exactly the reference."""
    from expresslane.quant.kernels import int4_dequantize

    k, n, group = 256, 272, 64
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(5))
    q, z, s = quantize_groups(w, group, sym=True)
    qweight, zeros, scales = pack_rows(q).to(DEVICE), z.to(DEVICE, torch.uint8), s.half().to(DEVICE)
    got = int4_dequantize(qweight, scales, zeros, group, torch.float32)
    assert torch.equal(got.cpu(), dequantize(qweight, zeros, scales, group).cpu())


@pytest.mark.parametrize("m", [1, 3, 5, 40, 200])
@pytest.mark.parametrize("n", [384, 16384])
def test_int4_linear_paths_on_gpu(m, n):
    """Int4Method's CUDA paths by rows and width (GEMV; the tile kernel for wide layers;
    dequantize + cuBLAS) in bf16 against float32 on the same inputs: weights rounded to bf16
    at most once (2^-8 relative), the output once more."""
    if DEVICE == "cpu":
        pytest.skip("needs CUDA (16-bit activations)")
    from expresslane.quant.int4 import Int4Method, awq_tensors
    from expresslane.quant.linear import QuantLinear

    k = 512
    x, w, _ = _inputs(m, k, n, seed=9, dtype=torch.bfloat16)
    with torch.device(DEVICE):
        layer = QuantLinear(k, [n], False, Int4Method("awq", 128))
    for name, t in awq_tensors(w, 128).items():
        layer.load_part(0, name, t.to(DEVICE))
    got = layer(x).float()
    wf = layer.dequantized_weight()
    want = x.float() @ wf.t()
    bound = (x.float().abs() @ wf.abs().t()) * 2**-7 + want.abs() * 2**-8 + 1e-4
    assert ((got - want).abs() <= bound).all()
