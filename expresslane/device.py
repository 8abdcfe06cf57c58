"""Host -> device transfers that never stall the host.

A copy from ordinary (pageable) host memory waits until the GPU has finished the work
queued before it, which would undo the overlap of host planning and GPU execution.
Copies from pinned memory with non_blocking=True are queued like kernels instead.

Also the device's arrival counters: the split kernels (split-K GEMVs, split-KV decode
attention) count their programs in on them to let the last one finish the sum.
"""

from __future__ import annotations

import contextlib
import mmap

import numpy as np
import torch


def host_tensor(data, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A CPU tensor to copy from: pinned when the destination is a GPU.
    (torch.tensor refuses pin_memory=True for a numpy array, so pinning is a separate step.)"""
    host = torch.tensor(data, dtype=dtype)  # a copy: the caller may reuse its numpy buffer
    return host.pin_memory() if device.type == "cuda" else host


def to_device(data, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return host_tensor(data, dtype, device).to(device, non_blocking=True)


def stage(parts: list[np.ndarray | tuple[np.ndarray, int, int]], device: torch.device) -> list[torch.Tensor]:
    """Integer arrays to the device in one copy (a copy from the host costs ~50 us of host
    time, a device copy ~5): written into one pinned int64 buffer, returned as flat int64
    views of it on the device. A part `(values, size, fill)` takes `size` elements: its
    values, then `fill` (padding). The buffer is fresh from torch's pinned-memory cache,
    which does not hand it out again before the copy has run."""
    parts = [p if isinstance(p, tuple) else (p, p.size, 0) for p in parts]
    sizes = [size for _, size, _ in parts]
    host = torch.empty(sum(sizes), dtype=torch.int64, pin_memory=device.type == "cuda")
    buf, offset = host.numpy(), 0
    for values, size, fill in parts:
        n = values.size
        buf[offset:offset + n] = values.reshape(-1)
        buf[offset + n:offset + size] = fill
        offset += size
    return list(host.to(device, non_blocking=True).split(sizes))


_COUNTERS: dict[tuple[torch.device, str, str | None], torch.Tensor] = {}
_MAX_COUNTERS = 1 << 15  # per device (a launch uses one per output tile: far fewer)
_SCRATCH: str | None = None


@contextlib.contextmanager
def scratch_set(name: str | None):
    """Launches inside take arrival counters and reused scratch buffers of set `name` (None: the
    default set): for kernels that run at the same time as the default set's, on another stream."""
    global _SCRATCH
    before, _SCRATCH = _SCRATCH, name
    try:
        yield
    finally:
        _SCRATCH = before


def current_scratch() -> str | None:
    return _SCRATCH


def arrival_counters(device: torch.device, owner: str = "main") -> torch.Tensor:
    """Per-tile arrival counters, all 0 between launches (the last program of a tile resets
    its own; launches on one stream never overlap). `owner`: a set of its own for kernels that
    run beside others on a side stream. Allocated on first use, which the CUDA-graph warm-up
    does before capture."""
    key = (device, owner, _SCRATCH)
    c = _COUNTERS.get(key)
    if c is None:
        c = _COUNTERS[key] = torch.zeros(_MAX_COUNTERS, dtype=torch.int32, device=device)
    return c


def kv_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed KV cache. On the host, a fresh anonymous mapping (the kernel's zero pages,
    written on first touch) rather than a pass over it: torch.zeros wrote the whole 4 GiB
    default budget at every CPU engine start (3 s on the 2-core machine, 12 s beside other
    jobs) and committed it, whatever the requests would use. Not calloc (np.zeros): glibc
    serves a large calloc from a free heap chunk when the process has one big enough (a heap
    fragmented by earlier work: chunks under its dynamic 32 MiB mmap threshold, freed) and then
    memsets it, committing the pages (tests/test_kv_alloc.py failed that way, +84 MiB of 128)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, nbytes)  # private, anonymous; unmapped when the tensor (which holds it) is freed
    if hasattr(mmap, "MADV_HUGEPAGE"):  # as numpy did for the calloc'd buffer: 2 MiB pages where the kernel allows
        buf.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)
