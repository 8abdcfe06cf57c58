"""FP8 W8A8: float8_e4m3 weights with one scale per output channel, activations quantized
per token at run time (dynamic), products accumulated in float32.

Checkpoints it reads (one linear's tensors, HF names' suffixes):

- unquantized (``--quantization fp8`` on a bf16/fp16/fp32 model): ``weight`` [N, K],
  quantized here;
- Hugging Face / vLLM ``quant_method: fp8``: ``weight`` e4m3 [N, K], ``weight_scale``
  per tensor ([] or [1]); or block-wise ``weight_scale_inv`` [ceil(N/bn), ceil(K/bk)]
  with ``weight_block_size: [bn, bk]``;
- compressed-tensors ``float-quantized``: ``weight`` e4m3 [N, K], ``weight_scale``
  [N, 1] (channel strategy) or [1] (tensor strategy).

A per-tensor scale becomes a per-channel one exactly (the same value on every row), so
merged q/k/v shards with different tensor scales stay exact. Block-wise weights are
dequantized and requantized per channel (rounding once more). Static activation scales
(``input_scale``) are not used: activations are always quantized per token, which is at
least as accurate.

Run time: on CUDA, activations are quantized per token by a Triton kernel; inputs of up to
``SMALL_M`` rows (decode) are then multiplied by the split-K GEMV (gemv.py: FP8 tensor-core
dots over N tiles and K slices), longer ones by ``torch._scaled_mm`` (cuBLAS FP8, row-wise
scales). Elsewhere the reference: the same quantization, then a float32 matmul. An input
may arrive quantized already (``Fp8Activation``: the fused RMSNorm and SiLU-and-mul kernels
write the e4m3 row beside the activation); then it is not quantized again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from expresslane.quant.linear import QuantLinear

FP8_MAX = 448.0  # largest finite float8_e4m3fn (the Triton kernels use the same literals)
SCALE_EPS = 1e-12  # an all-zero row gets this scale instead of 0

SMALL_M = 16  # rows up to which the split-K GEMV runs on CUDA (1.2-1.6x _scaled_mm's speed at 16)


@dataclass(frozen=True)
class Fp8Activation:
    """An activation with its per-token FP8 quantization, written by the kernel that produced
    it (layers/triton_ops.py) for an FP8 linear layer: ``q, scale`` are exactly
    ``per_token_quant_fp8(x)`` (``quantize_per_row`` of the rounded activation), so a layer fed
    this computes what it computes from ``x`` alone, one launch fewer."""

    x: torch.Tensor  # [M, K] in the activation dtype
    q: torch.Tensor  # float8_e4m3fn [M, K]
    scale: torch.Tensor  # float32 [M, 1]: max|row| / 448


def quantize_per_row(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, C] float -> (e4m3 [R, C], float32 scale [R]): scale = max|row| / 448."""
    w = w.float()
    scale = w.abs().amax(dim=-1).clamp(min=SCALE_EPS) / FP8_MAX
    q = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def fp8_linear_reference(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                         bias: torch.Tensor | None, xq: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Dequantize-then-matmul in float32: what every FP8 path computes, up to summation order.
    `xq`: x's quantization (e4m3 [M, K], scales [M, 1]) when it arrived with x."""
    xq, xs = xq or quantize_per_row(x.reshape(-1, x.shape[-1]))
    out = (xq.float() @ weight.float().t()) * xs.reshape(-1, 1) * weight_scale[None, :]
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).view(*x.shape[:-1], -1)


def dequantize(weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """float32 [N, K] of a stored e4m3 weight with per-channel scales."""
    return weight.float() * weight_scale[:, None]


def _shard_to_channel(parts: dict[str, torch.Tensor], block_size: list[int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One checkpoint shard's tensors -> (e4m3 [n, K], float32 per-channel scale [n])."""
    w = parts["weight"]
    n = w.shape[0]
    if w.dtype != torch.float8_e4m3fn:  # an unquantized checkpoint: quantize at load
        if "weight_scale" in parts or "weight_scale_inv" in parts:
            raise ValueError(f"an FP8 weight scale comes with a {w.dtype} weight; expected float8_e4m3fn")
        return quantize_per_row(w)
    if "weight_scale_inv" in parts:  # block-wise: requantize per channel
        s = parts["weight_scale_inv"].float()
        bn, bk = block_size or (128, 128)
        full = s.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :w.shape[1]]
        return quantize_per_row(w.float() * full)
    s = parts["weight_scale"].float()
    if s.numel() == 1:
        return w, s.reshape(1).expand(n).contiguous()
    if s.numel() == n:
        return w, s.reshape(n).contiguous()
    raise ValueError(f"FP8 weight_scale of shape {tuple(s.shape)} fits neither per-tensor nor per-channel "
                     f"scales of a weight with {n} rows")


class Fp8Method:
    """Owns an FP8 linear's weights (``weight`` e4m3 [N, K], ``weight_scale`` float32 [N]) and its matmul."""

    name = "fp8"

    def __init__(self, serialized: bool, block_size: list[int] | None = None):
        self.serialized = serialized  # the checkpoint holds e4m3 weights already
        self.block_size = block_size
        if serialized:
            self.required = ("weight", "weight_scale_inv") if block_size else ("weight", "weight_scale")
        else:
            self.required = ("weight",)
        self.ignored = ("input_scale",)

    def build(self, layer: nn.Module, shards: list[dict[str, torch.Tensor]]) -> None:
        qs, scales = zip(*(_shard_to_channel(p, self.block_size) for p in shards))
        device = layer.device
        layer.weight = nn.Parameter(torch.cat(qs).to(device), requires_grad=False)
        layer.weight_scale = nn.Parameter(torch.cat(scales).to(device, torch.float32), requires_grad=False)

    def shape(self, layer: nn.Module) -> tuple[int, int]:
        return tuple(layer.weight.shape)

    def dequantized(self, layer: nn.Module) -> torch.Tensor:
        return dequantize(layer.weight, layer.weight_scale)

    def apply(self, layer: nn.Module, x: torch.Tensor | Fp8Activation) -> torch.Tensor:
        xq = None
        if isinstance(x, Fp8Activation):  # quantized by its producer
            x, xq = x.x, (x.q, x.scale)
        if not x.is_cuda:
            return fp8_linear_reference(x, layer.weight, layer.weight_scale, layer.bias, xq)
        from expresslane.quant.gemv import gemv
        from expresslane.quant.kernels import per_token_quant_fp8, quant_gemm

        x2 = x.reshape(-1, x.shape[-1])
        n, m = layer.weight.shape[0], x2.shape[0]
        if m <= SMALL_M:
            out = gemv(x2, layer.weight, layer.weight_scale, layer.bias, xq=xq)
        elif x.dtype == torch.float32:  # (_scaled_mm writes bf16 only; this kernel quantizes x as it goes)
            out = quant_gemm(x2, layer.weight, layer.weight_scale, None, layer.bias, n, None)
        else:
            xq, xs = xq or per_token_quant_fp8(x2)
            # row-wise scaled FP8 GEMMs write bf16 only
            out = torch._scaled_mm(xq, layer.weight.t(), scale_a=xs, scale_b=layer.weight_scale[None, :],
                                   out_dtype=torch.bfloat16)
            if layer.bias is not None:
                out = out + layer.bias
            out = out.to(x.dtype)
        return out.view(*x.shape[:-1], n)


def takes_fp8_input(layer: nn.Module) -> bool:
    """Whether `layer` is an FP8 linear layer: a fused producer of its input may hand it an
    Fp8Activation."""
    return isinstance(layer, QuantLinear) and isinstance(layer.method, Fp8Method)
