"""What the benchmark scripts share: the H200's floors, result lines, profiler sums.
(Imported as a sibling module: the scripts run as `python benchmarks/NAME.py`.)"""

from __future__ import annotations

import json

PEAK_BW = 4.27e12  # B/s, measured device copy (DESIGN §8)
PEAK_FLOPS = 805e12  # bf16 matmul (DESIGN §8)


def emit(out: str | None, **row) -> None:
    """Print one result as a JSON line, and append it to `out` when given."""
    line = json.dumps(row)
    print(line, flush=True)
    if out:
        with open(out, "a") as f:
            f.write(line + "\n")


def weight_bytes(model) -> int:
    """Bytes read per decode step: every weight except the embedding table (only rows are read)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if model.lm_head is not None:
        total -= model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    return total


def kernel_intervals(prof) -> list[tuple[float, float, str]]:
    """(start µs, end µs, name) of every GPU activity in a torch.profiler trace, in order
    (user annotations, which the profiler also puts on the GPU timeline, left out)."""
    import torch

    return sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                  if e.device_type == torch.autograd.DeviceType.CUDA
                  and not getattr(e, "is_user_annotation", False))


def busy_us(intervals) -> float:
    """Time covered by the union of the intervals (one stream: overlaps are copies)."""
    busy, end = 0.0, float("-inf")
    for s, e, _ in intervals:
        if e > end:
            busy += e - max(s, end)
            end = e
    return busy
