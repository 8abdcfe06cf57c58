"""Host -> device transfers that never stall the host.

A copy from ordinary (pageable) host memory waits until the GPU has finished the work
queued before it, which would undo the overlap of host planning and GPU execution.
Copies from pinned memory with non_blocking=True are queued like kernels instead.
"""

from __future__ import annotations

import numpy as np
import torch


def host_tensor(data, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A CPU tensor to copy from: pinned when the destination is a GPU.
    (torch.tensor refuses pin_memory=True for a numpy array, so pinning is a separate step.)"""
    host = torch.tensor(data, dtype=dtype)  # a copy: the caller may reuse its numpy buffer
    return host.pin_memory() if device.type == "cuda" else host


def to_device(data, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return host_tensor(data, dtype, device).to(device, non_blocking=True)


def stage(arrays: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """Integer arrays to the device in one copy (~50 us of host time per copy from the
    host): packed into one pinned int64 buffer, returned as int64 views of their shapes.
    The buffer is fresh from torch's pinned-memory cache, which does not hand it out
    again before the copy has run."""
    sizes = [a.size for a in arrays]
    host = torch.empty(sum(sizes), dtype=torch.int64, pin_memory=device.type == "cuda")
    if sizes:
        np.concatenate([a.reshape(-1) for a in arrays], out=host.numpy())
    flat = host.to(device, non_blocking=True)
    return [part.view(a.shape) for part, a in zip(flat.split(sizes), arrays)]
