"""Multi-LoRA projections: y = base(x), then for every token with an adapter
y += (x @ A[slot]^T) @ B[slot]^T, its slot's weights, grouped by slot (Punica / S-LoRA).

Each wrapped projection holds its adapters' weights stacked by slot::

    A  [slots, num_slices * R, in]    slice i's A in rows i*R .. i*R + r_i (zeros past its rank)
    B  [slots, out, R]                 slice i's output columns, scale folded in (zeros past r_i)

as views of one buffer, `LoRAState.slots` [slots, elements], each projection's A then B side by
side in a slot's row, so an adapter loads into a slot with one copy.

Slot 0 is the base model: its rows stay zero and no kernel reads them. A step's rows reach
the layers through `LoRAState.step`, which the runner sets before each forward (one object
the wrapped layers share, as the attention layers share their KV cache). A step's metadata
has fixed shapes (`token_slots` [T], `slot_starts`/`slot_counts` [slots]) so a CUDA graph can
capture the Triton kernels; `groups` is the host's grouping for the torch path.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from expresslane.distributed.layers import RowParallelLinear


@dataclass(slots=True)
class LoRAStep:
    """One step's tokens by adapter slot."""

    groups: list[tuple[int, torch.Tensor]]  # (slot, its token indices), slots > 0 only
    sorted_tokens: torch.Tensor  # [T] int32: token indices ordered by slot (stable)
    slot_starts: torch.Tensor  # [slots] int32: where each slot's tokens start in sorted_tokens
    slot_counts: torch.Tensor  # [slots] int32
    num_tokens: int
    # the same, on the host (numpy: order, starts, counts): what a CUDA graph loads into its own
    host: tuple | None = None

    @classmethod
    def of(cls, token_slots: np.ndarray, num_slots: int, device: torch.device, groups: bool = True
           ) -> LoRAStep | None:
        """None when no token has an adapter: the step runs the base model only. `groups`: the
        torch path's host grouping (the kernels need none)."""
        if not token_slots.any():
            return None
        order = np.argsort(token_slots, kind="stable").astype(np.int32)
        counts = np.bincount(token_slots, minlength=num_slots).astype(np.int32)
        starts = (np.cumsum(counts) - counts).astype(np.int32)
        by_slot = [(int(s), torch.from_numpy(order[starts[s]:starts[s] + counts[s]].astype(np.int64)).to(device))
                   for s in np.flatnonzero(counts[1:]) + 1] if groups else []
        return cls(by_slot, torch.from_numpy(order).to(device), torch.from_numpy(starts).to(device),
                   torch.from_numpy(counts).to(device), len(token_slots), (order, starts, counts))

    @classmethod
    def static(cls, max_tokens: int, num_slots: int, device: torch.device) -> LoRAStep:
        """A CUDA graph's own: fixed buffers the graph's kernels read, loaded before each replay."""
        zeros = lambda n: torch.zeros(n, dtype=torch.int32, device=device)  # noqa: E731
        return cls([], zeros(max_tokens), zeros(num_slots), zeros(num_slots), max_tokens)

    def fields(self, step: LoRAStep | None, padded: int) -> list:
        """(buffer, values, fill) for `_Graphs._load`: `step`'s metadata into this static one
        (None: no adapter in the step, every count 0)."""
        if step is None:
            return [(self.slot_counts, np.zeros(len(self.slot_counts), dtype=np.int32), 0)]
        order, starts, counts = step.host
        return [(self.sorted_tokens[:padded], order, 0), (self.slot_starts, starts, 0), (self.slot_counts, counts, 0)]


class LoRAState:
    """What every wrapped projection of one model shares: the current step and the kernel choice."""

    def __init__(self, num_slots: int, max_rank: int, use_triton: bool, dtype: torch.dtype):
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.dtype = dtype  # the activations' (the slots' weights are kept in it)
        self.use_triton = use_triton
        self.step: LoRAStep | None = None
        self.slots: torch.Tensor | None = None

    def allocate(self, modules: list[LoRALinear], device: torch.device) -> None:
        self.slots = torch.zeros(self.num_slots, sum(m.slot_elements for m in modules), dtype=self.dtype,
                                 device=device)
        offset = 0
        for module in modules:
            module.place(self.slots, offset)
            offset += module.slot_elements


class LoRALinear(nn.Module):
    """A projection (merged or not) with its adapters' slots beside it. Under tensor parallelism
    a column-parallel base keeps rows `b_rows[i]` of slice i's B, a row-parallel one columns
    `a_cols` of every A, its delta joining the partial sum before the reduction."""

    def __init__(self, base: nn.Module, slices: list[tuple[int, int]], full_sizes: list[int], full_in: int,
                 state: LoRAState, b_rows: list[tuple[int, int]] | None = None,
                 a_cols: tuple[int, int] | None = None):
        super().__init__()
        self.base = base
        self.slices = slices  # (output offset, size) of each adapted projection, on this rank
        self.full_sizes, self.full_in = full_sizes, full_in  # the checkpoint's (an adapter's) shapes
        self.b_rows = b_rows or [(0, size) for _, size in slices]
        self.a_cols = a_cols or (0, full_in)
        self.row_parallel = isinstance(base, RowParallelLinear)
        self.state = state
        self.a_shape = (len(slices) * state.max_rank, self.a_cols[1])
        self.b_shape = (sum(size for _, size in slices), state.max_rank)
        self.a_elements, self.b_elements = self.a_shape[0] * self.a_shape[1], self.b_shape[0] * self.b_shape[1]
        self.slot_elements = _aligned(self.a_elements) + _aligned(self.b_elements)
        self.offset = 0  # in a slot's row of `LoRAState.slots`
        self.lora_a = self.lora_b = None  # set by `place`

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        step = self.state.step
        if step is None:
            return self.base(x)
        if self.row_parallel:
            return self.base(x, add=self._add)
        return self._add(self.base(x), x)

    def _add(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return add_lora(y, x, self.lora_a, self.lora_b, self.slices, self.state.step, self.state.use_triton)

    def place(self, slots: torch.Tensor, offset: int) -> None:
        """Take A and B as views of `slots` from `offset`."""
        self.offset = offset
        self.lora_a, self.lora_b = self._views(slots)

    def _views(self, row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = self.offset, self.offset + _aligned(self.a_elements)
        return (row[..., a:a + self.a_elements].unflatten(-1, self.a_shape),
                row[..., b:b + self.b_elements].unflatten(-1, self.b_shape))

    def write_slot(self, row: torch.Tensor, parts: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Write an adapter into `row` (one slot's elements, zeros): `parts` by slice index (A [r, in],
        B [size, r], the full checkpoint shapes)."""
        r_max = self.state.max_rank
        a, b = self._views(row)
        col, cols = self.a_cols
        for i, (part_a, part_b) in parts.items():
            offset, size = self.slices[i]
            first, rows = self.b_rows[i]
            r = part_a.shape[0]
            a[i * r_max:i * r_max + r].copy_(part_a[:, col:col + cols])
            b[offset:offset + size, :r].copy_(part_b[first:first + rows])


def _aligned(elements: int) -> int:
    """Rounded up to 64 elements: every A and B starts aligned for the kernels' loads."""
    return -(-elements // 64) * 64


def add_lora(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
             slices: list[tuple[int, int]], step: LoRAStep, use_triton: bool) -> torch.Tensor:
    """y + each token's adapter delta (in place). The one seam between the two paths: the
    Triton kernels (segmented shrink and expand) or the torch reference."""
    if use_triton:
        from expresslane.layers.lora_kernels import lora_expand, lora_shrink

        lora_expand(lora_shrink(x, lora_a, step), lora_b, y, slices, step)
        return y
    r_max = lora_b.shape[-1]
    for slot, idx in step.groups:
        u = x[idx] @ lora_a[slot].t()  # [t, slices * R]
        delta = torch.cat([u[:, i * r_max:(i + 1) * r_max] @ lora_b[slot, off:off + size].t()
                           for i, (off, size) in enumerate(slices)], dim=-1)
        y.index_add_(0, idx, delta.to(y.dtype))
    return y
