"""Multi-LoRA projections: y = base(x), then for every token with an adapter
y += (x @ A[slot]^T) @ B[slot]^T, its slot's weights, grouped by slot (Punica / S-LoRA).

Each wrapped projection holds its adapters' weights stacked by slot::

    A  [slots, num_slices * R, in]    slice i's A in rows i*R .. i*R + r_i (zeros past its rank)
    B  [slots, out, R]                 slice i's output columns, scale folded in (zeros past r_i)

as views of one buffer, `LoRAState.slots` [slots, elements], each projection's A then B side by
side in a slot's row, so an adapter loads into a slot with one copy.

Slot 0 is the base model: its rows stay zero and no kernel reads them. A step's rows reach
the layers through `LoRAState.step`, which the runner sets before each forward (one object
the wrapped layers share, as the attention layers share their KV cache). The kernels read a
step's tokens by slot and its tiles, in buffers whose sizes depend on the token count only, so
a CUDA graph can capture them; `groups` is the host's grouping for the torch path.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from expresslane.device import stage
from expresslane.distributed.layers import ColumnParallelLinear, RowParallelLinear


TILE_TOKENS = 16  # tokens of one slot a kernel tile takes (lora_kernels.BLOCK_M)


def max_tiles(num_tokens: int, num_slots: int) -> int:
    """The most tiles `num_tokens` tokens over `num_slots - 1` adapter slots make: every run of
    one slot ends in at most one partial tile."""
    return -(-num_tokens // TILE_TOKENS) + max(0, min(num_slots - 1, num_tokens) - 1)


@dataclass(slots=True)
class LoRAStep:
    """One step's tokens by adapter slot. On the host: `order`, the token indices slot by slot
    (stable), and `tiles`, each up to TILE_TOKENS tokens of one slot (its slot, first index in
    `order`, count); the kernels read them from the device (`kernel_inputs`), copied on first
    use: a step that replays a CUDA graph loads them into the graph's own buffers instead."""

    groups: list[tuple[int, torch.Tensor]]  # (slot, its token indices), slots > 0 only: the torch path's
    order: np.ndarray | None  # [T] int32
    tiles: np.ndarray | None  # [P, 3] int32
    num_slots: int
    device: torch.device
    on_device: tuple[torch.Tensor, torch.Tensor] | None = None  # (order, tiles)

    @classmethod
    def of(cls, token_slots: np.ndarray, num_slots: int, device: torch.device, groups: bool = True
           ) -> LoRAStep | None:
        """None when no token has an adapter: the step runs the base model only. `groups`: the
        torch path's host grouping (the kernels need none)."""
        if not token_slots.any():
            return None
        order = np.argsort(token_slots, kind="stable").astype(np.int32)
        counts = np.bincount(token_slots, minlength=num_slots)
        starts = np.cumsum(counts) - counts
        active = np.flatnonzero(counts[1:]) + 1
        tiles = np.array([(s, first, min(TILE_TOKENS, starts[s] + counts[s] - first)) for s in active.tolist()
                          for first in range(starts[s], starts[s] + counts[s], TILE_TOKENS)], dtype=np.int32)
        by_slot = [(int(s), torch.from_numpy(order[starts[s]:starts[s] + counts[s]].astype(np.int64)).to(device))
                   for s in active] if groups else []
        return cls(by_slot, order, tiles, num_slots, device)

    @classmethod
    def static(cls, max_tokens: int, num_slots: int, device: torch.device) -> LoRAStep:
        """A CUDA graph's own: fixed buffers the graph's kernels read, loaded before each replay."""
        buffers = (torch.zeros(max_tokens, dtype=torch.int32, device=device),
                   torch.zeros(max_tiles(max_tokens, num_slots), 3, dtype=torch.int32, device=device))
        return cls([], None, None, num_slots, device, buffers)

    def kernel_inputs(self, num_rows: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(order [T], tiles [P, 3]) on the device, int32, and how many tiles a grid over
        `num_rows` rows covers."""
        if self.on_device is None:
            order, tiles = stage([self.order, self.tiles], self.device)
            self.on_device = order.to(torch.int32), tiles.to(torch.int32).view(-1, 3)
        order, tiles = self.on_device
        return order, tiles, min(tiles.shape[0], max_tiles(num_rows, self.num_slots))

    def fields(self, step: LoRAStep | None, padded: int) -> list:
        """(buffer, values, fill) for `_Graphs._load`: `step`'s tokens and tiles into this static
        one's buffers for a graph of `padded` tokens (None: no adapter in the step, no tile)."""
        order, tiles = self.on_device
        tiles = tiles[:max_tiles(padded, self.num_slots)]
        if step is None:
            return [(tiles, np.zeros(0, dtype=np.int32), 0)]
        return [(order[:padded], step.order, 0), (tiles, step.tiles, 0)]


class LoRAState:
    """What every wrapped projection of one model shares: the current step and the kernel choice."""

    def __init__(self, num_slots: int, max_rank: int, use_triton: bool, dtype: torch.dtype):
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.dtype = dtype  # the activations' (the slots' weights are kept in it)
        self.use_triton = use_triton
        self.step: LoRAStep | None = None
        self.slots: torch.Tensor | None = None
        self.side_stream: torch.cuda.Stream | None = None  # the kernels' shrinks, beside the base projections

    def allocate(self, modules: list[LoRALinear], device: torch.device) -> None:
        self.slots = torch.zeros(self.num_slots, sum(m.slot_elements for m in modules), dtype=self.dtype,
                                 device=device)
        if self.use_triton and device.type == "cuda":
            self.side_stream = torch.cuda.Stream(device)
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
        self.inline_tile: int | None = None  # `lora_gemv`'s output tile for one-token steps (set by `place`)

    @property
    def inline(self) -> bool:
        """One-token steps run `lora_gemv`."""
        return self.inline_tile is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        step = self.state.step
        if step is None:
            return self.base(x)
        if self.inline and x.shape[0] == 1:
            return self._inline(x, step)
        if self.row_parallel:
            return self.base(x, add=self._add)
        if self.state.side_stream is None:
            return self._add(self.base(x), x)
        return self._add_overlapped(x, step)

    def _add_overlapped(self, x: torch.Tensor, step: LoRAStep) -> torch.Tensor:
        """base(x) + delta with the shrink (which reads x alone) on the side stream while the base
        projection runs: a decode step's shrink is a small, latency-bound launch. Its inputs and
        output are allocated on this stream before the fork, so none is reused before the join."""
        from expresslane.layers.lora_kernels import lora_expand, lora_shrink, shrink_output

        step.kernel_inputs(x.shape[0])
        part = shrink_output(x, self.lora_a)
        main, side = torch.cuda.current_stream(), self.state.side_stream
        side.wait_stream(main)
        with torch.cuda.stream(side):
            lora_shrink(x, self.lora_a, step, part)
        y = self.base(x)
        main.wait_stream(side)
        lora_expand(part, self.lora_b, y, self.slices, step)
        return y

    def _inline(self, x: torch.Tensor, step: LoRAStep) -> torch.Tensor:
        """A one-token step: the base projection's split-K GEMV with the adapter inline, one launch."""
        from expresslane.layers.lora_kernels import lora_gemv

        x = x if x.stride(-1) == 1 else x.contiguous()
        bias = None if self.row_parallel else self.base.bias
        y = lora_gemv(x, self.base.weight, bias, self.lora_a, self.lora_b, self.slices, step, self.inline_tile)
        return self.base.reduce(y) if self.row_parallel else y

    def _add(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return add_lora(y, x, self.lora_a, self.lora_b, self.slices, self.state.step, self.state.use_triton)

    def place(self, slots: torch.Tensor, offset: int) -> None:
        """Take A and B as views of `slots` from `offset`."""
        self.offset = offset
        self.lora_a, self.lora_b = self._views(slots)
        if self.state.use_triton:
            from expresslane.layers.lora_kernels import inline_block_n

            if type(self.base) in (nn.Linear, RowParallelLinear, ColumnParallelLinear):
                self.inline_tile = inline_block_n(self.base.weight, self.slices)

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
