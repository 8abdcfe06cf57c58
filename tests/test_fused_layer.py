"""The fused decode layer (``fused_decode_layer``): each fused GEMV variant against torch, and a
tiny Llama's decode with the switch on against the switch off (Triton's interpreter on CPU)."""

import pytest
import torch

pytest.importorskip("triton")

from expresslane.layers.fused_gemv import fused_gemv  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# the interpreter's dots have no 16-bit floats: float32 there (exact-precision dot), bf16 on a GPU
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32
ROWS = [1, 3, 8]
SPLITS = [1, 3]  # one program per tile; an uneven split over 3 programs (the last of 3 K-slices is short)


def _counters_clear():
    from expresslane.device import arrival_counters
    assert int(arrival_counters(torch.device(DEVICE)).abs().sum()) == 0  # every tile's last program reset its counter


def _tensors(m: int, k: int, n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * 2
    w = torch.randn(n, k, generator=g) * 0.05
    bias = torch.randn(n, generator=g) * 0.1
    res = torch.randn(m, n, generator=g)
    return x, w, bias, res


def _check(got: torch.Tensor, want: torch.Tensor, scale: torch.Tensor) -> None:
    """float32: sums in another order (bound ~ K ulps of |x| @ |w|); bf16: the output's rounding."""
    tol = 2**-7 if DTYPE == torch.bfloat16 else 2**-16
    assert got.shape == want.shape and got.dtype == DTYPE
    err = (got.float().cpu() - want).abs()
    assert (err <= scale * tol + tol).all(), float(err.max())


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("split", SPLITS)
def test_norm_folded_into_the_gemv(m, split):
    """RMSNorm with its weight folded into W's columns: (x @ (W g)^T) * rsqrt(mean(x^2) + eps)
    against norm(x) @ W^T with the weight applied to x; N odd (a masked edge tile), K not a
    multiple of the tile (masked last step), a bias after the scale (Qwen2's qkv)."""
    k, n, eps = 320, 77, 1e-5
    x, w, bias, _ = _tensors(m, k, n, seed=10 + m)
    gamma = torch.rand(k, generator=torch.Generator().manual_seed(1)) + 0.5
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * gamma
    want = normed @ w.t() + bias
    got = fused_gemv(x.to(DEVICE, DTYPE), (w * gamma).to(DEVICE, DTYPE), bias.to(DEVICE, DTYPE), norm_eps=eps,
                     block_n=32, block_k=64, split=split)
    _check(got, want, normed.abs() @ w.abs().t() + bias.abs())
    _counters_clear()


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("split", SPLITS)
def test_residual_added_in_the_epilogue(m, split):
    """o_proj's form: x @ W^T + residual, with N odd and K a whole number of tiles."""
    k, n = 256, 45
    x, w, _, res = _tensors(m, k, n, seed=20 + m)
    want = x @ w.t() + res
    got = fused_gemv(x.to(DEVICE, DTYPE), w.to(DEVICE, DTYPE), residual=res.to(DEVICE, DTYPE), block_n=32,
                     block_k=64, split=split)
    _check(got, want, x.abs() @ w.abs().t() + res.abs())
    _counters_clear()


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("split", SPLITS)
def test_silu_and_mul_in_the_prologue(m, split):
    """down's form: silu(gate) * up of gate|up [M, 2K], then @ W^T + residual."""
    k, n = 192, 33
    gate_up, _, _, _ = _tensors(m, 2 * k, 1, seed=30 + m)
    _, w, bias, res = _tensors(m, k, n, seed=40 + m)
    gate, up = gate_up.chunk(2, dim=-1)
    act = torch.nn.functional.silu(gate) * up
    want = act @ w.t() + bias + res
    got = fused_gemv(gate_up.to(DEVICE, DTYPE), w.to(DEVICE, DTYPE), bias.to(DEVICE, DTYPE), silu=True,
                     residual=res.to(DEVICE, DTYPE), block_n=32, block_k=64, split=split)
    _check(got, want, act.abs() @ w.abs().t() + bias.abs() + res.abs())
    _counters_clear()


def test_default_tiles_split_and_agree_with_one_program():
    """The default split (several K-slices, from gemv_config) against SPLIT = 1 on the same inputs."""
    k, n = 1024, 64
    x, w, _, res = _tensors(3, k, n, seed=50)
    args = (x.to(DEVICE, DTYPE), w.to(DEVICE, DTYPE))
    one = fused_gemv(*args, norm_eps=1e-6, residual=res.to(DEVICE, DTYPE), split=1)
    many = fused_gemv(*args, norm_eps=1e-6, residual=res.to(DEVICE, DTYPE))
    _check(many, one.float().cpu(), one.float().cpu().abs())
    _counters_clear()


def test_rejects_what_it_cannot_run():
    x = torch.zeros(17, 64, device=DEVICE, dtype=DTYPE)
    with pytest.raises(ValueError, match="1 to 16 rows"):
        fused_gemv(x, torch.zeros(8, 64, device=DEVICE, dtype=DTYPE))
    with pytest.raises(ValueError, match="does not fit"):
        fused_gemv(x[:2], torch.zeros(8, 64, device=DEVICE, dtype=DTYPE), silu=True)
