"""What the GPU profiling scripts share beyond the bench package (whose floors, prompts
and clients they use): result lines and profiler sums. (Imported as a sibling module:
the scripts run as `python benchmarks/NAME.py`.)"""

from __future__ import annotations

import json


def emit(out: str | None, **row) -> None:
    """Print one result as a JSON line, and append it to `out` when given."""
    line = json.dumps(row)
    print(line, flush=True)
    if out:
        with open(out, "a") as f:
            f.write(line + "\n")


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
