"""SwiGLU on a merged gate|up projection: one fused Triton kernel when `fused` (the
`triton` attention backend), torch ops otherwise."""

import torch
import torch.nn.functional as F


def silu_and_mul(gate_up: torch.Tensor, fused: bool = False) -> torch.Tensor:
    """SwiGLU on a merged [.., 2*I] gate|up projection."""
    if fused:
        from expresslane.layers import triton_ops
        return triton_ops.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
