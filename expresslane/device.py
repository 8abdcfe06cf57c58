"""Host -> device transfers that never stall the host.

A copy from ordinary (pageable) host memory waits until the GPU has finished the work
queued before it, which would undo the overlap of host planning and GPU execution.
Copies from pinned memory with non_blocking=True are queued like kernels instead.
"""

from __future__ import annotations

import torch


def host_tensor(data, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A CPU tensor to copy from: pinned when the destination is a GPU."""
    return torch.tensor(data, dtype=dtype, pin_memory=device.type == "cuda")


def to_device(data, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return host_tensor(data, dtype, device).to(device, non_blocking=True)
