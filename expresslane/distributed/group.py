"""The tensor-parallel group a model is built for: this rank, the group size, and the
collectives the parallel layers use (torch.distributed's; NCCL on GPU, gloo on CPU).

``TPGroup.single()`` is the group of one: every collective is the identity, so a model
built for it is the plain single-device model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True, slots=True)
class TPGroup:
    rank: int
    size: int
    group: object = None  # the torch.distributed group of the tensor collectives (None: the default group)
    expert_parallel: bool = False  # MoE experts split whole over the ranks (else each expert's weights are)

    @classmethod
    def single(cls) -> "TPGroup":
        return cls(0, 1)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] on every rank -> [..., size * n], rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def all_gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        """[n, ...] on every rank -> [size * n, ...], rank order."""
        if self.size == 1:
            return x
        out = torch.empty((self.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
        gather(out, x.contiguous(), group=self.group)
        return out

    def all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        """Rows split in `size` equal parts: part r goes to rank r; the parts received, in rank order."""
        if self.size == 1:
            return x
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x.contiguous(), group=self.group)
        return out

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        if self.size > 1:
            dist.broadcast(x, src=src, group=self.group)
        return x
