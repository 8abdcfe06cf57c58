"""SwiGLU (and Gemma's GeGLU) on a merged gate|up projection: one fused Triton kernel when
`fused` (the `triton` attention backend), torch ops otherwise."""

import torch
import torch.nn.functional as F


def gelu_and_mul(gate_up: torch.Tensor, fused: bool = False, fp8_out: bool = False):
    """GeGLU (gelu, tanh approximation) on a merged [.., 2*I] gate|up projection (Gemma)."""
    if fused:
        from expresslane.layers import triton_ops
        return triton_ops.silu_and_mul(gate_up, fp8_out, gelu=True)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def silu_and_mul(gate_up: torch.Tensor, fused: bool = False, fp8_out: bool = False):
    """SwiGLU on a merged [.., 2*I] gate|up projection. `fp8_out` (fused only): it feeds an FP8
    linear layer; decode-sized outputs then come as an Fp8Activation (layers/triton_ops.py)."""
    if fused:
        from expresslane.layers import triton_ops
        return triton_ops.silu_and_mul(gate_up, fp8_out)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
