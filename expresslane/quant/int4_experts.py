"""INT4 weight-only experts (AWQ / GPTQ checkpoints of Mixtral and Qwen3-MoE; vLLM's moe_wna16).

One ``Int4Experts`` holds one projection family of a SparseMoE's experts, stacked in the
W4A16 kernels' layout (int4.py), one slice per expert:

    qweight [E, K/8, N] int32   input 8r + j of column n at nibble j of word [e, r, n]
    scales  [E, K/G, N]         the checkpoint's dtype (fp16 scales stay exact)
    zeros   [E, K/G, N] uint8

``w13`` is gate|up ([E, H/8, 2I]: gate columns, then up columns) and ``w2`` is down
([E, I/8, H]). Each expert's projection arrives as its checkpoint tensors (qweight, qzeros,
scales, g_idx), in any order; the part is unpacked into its slice when its last one arrives.
Indexing (``experts[e]``) gives expert e's float32 weight [N, K]: the torch reference path
(CPU, tests) dequantizes one expert at a time, and the fused Triton GEMMs read the packed
tensors directly.
"""

from __future__ import annotations

import torch
from torch import nn

from expresslane.quant.int4 import Int4Method, dequantize, pack_rows


class Int4Experts(nn.Module):
    def __init__(self, num_experts: int, n: int, k: int, method: Int4Method):
        super().__init__()
        group = method.group_size if method.group_size > 0 else k
        if k % group or group % 16 or k % 8:
            raise ValueError(f"{method.name} experts: {k} inputs do not split into groups of {group} (a multiple "
                             "of 16)")
        self.method, self.group, self.n, self.k = method, group, n, k
        self.qweight = nn.Parameter(torch.zeros(num_experts, k // 8, n, dtype=torch.int32), requires_grad=False)
        self.scales = nn.Parameter(torch.zeros(num_experts, k // group, n, dtype=torch.float16), requires_grad=False)
        self.zeros = nn.Parameter(torch.zeros(num_experts, k // group, n, dtype=torch.uint8), requires_grad=False)
        self._pending: dict[tuple[int, int], dict[str, torch.Tensor]] = {}

    @property
    def shape(self) -> tuple[int, int, int]:
        """(E, N, K), as a stacked float weight's."""
        return self.qweight.shape[0], self.n, self.k

    def load(self, expert: int, columns: slice, name: str, tensor: torch.Tensor) -> bool:
        """One checkpoint tensor of `expert`'s projection that fills output `columns`; True once
        the projection's last tensor has arrived and its slice is filled."""
        method = self.method
        if name not in method.required:
            raise ValueError(f"checkpoint tensor {name!r} is not part of a {method.name} expert "
                             f"(expected {', '.join(method.required)})")
        parts = self._pending.setdefault((expert, columns.start), {})
        if name in parts:
            raise ValueError(f"checkpoint tensor {name!r} arrives twice for expert {expert}")
        parts[name] = tensor
        if any(r not in parts for r in method.required):
            return False
        del self._pending[(expert, columns.start)]
        q, z, s, g_idx = method.unpack(parts, self.k)
        if g_idx is not None and not torch.equal(g_idx.cpu(), torch.arange(self.k) // self.group):
            raise ValueError(f"{method.name} experts with desc_act (a g_idx that reorders the inputs) are not "
                             "supported: quantize the experts without act-order")
        width = columns.stop - columns.start
        if q.shape[1] != width:
            raise ValueError(f"{method.name} expert {expert}: {q.shape[1]} outputs; the model's projection has "
                             f"{width}")
        dev = self.qweight.device
        self.qweight.data[expert, :, columns].copy_(pack_rows(q).to(dev))
        if self.scales.dtype != s.dtype:  # the checkpoint's scale dtype (fp16, or bf16 from some tools)
            self.scales.data = self.scales.data.to(s.dtype)
        self.scales.data[expert, :, columns].copy_(s.to(dev))
        self.zeros.data[expert, :, columns].copy_(z.to(dev, torch.uint8))
        return True

    def __getitem__(self, expert: int) -> torch.Tensor:
        """Expert `expert`'s weight, float32 [N, K]."""
        return dequantize(self.qweight[expert], self.zeros[expert], self.scales[expert], self.group).t()
