"""LoRA slot loads on a side stream (inline on the host), each after the steps that read its slot
(docs/architecture.md, LoRA adapters)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable

import torch

QUEUED = "all"  # every step queued so far


class SlotReads:
    """Which steps read each slot; marks: events after the steps before them."""

    KEEP = 8

    def __init__(self):
        self.steps = 0
        self.last_read: dict[int, int] = {}
        self.marks: deque[tuple[int, object]] = deque(maxlen=self.KEEP)  # (steps before it, mark)

    def step(self, slots: Iterable[int], mark: Callable[[], object]) -> None:
        """Before a step reading `slots` is queued; `mark()` is called when a read has no mark after it."""
        latest = max(self.last_read.values(), default=-1)
        if latest >= 0 and (not self.marks or self.marks[-1][0] <= latest):
            self.marks.append((self.steps, mark()))
        for slot in slots:
            self.last_read[slot] = self.steps
        self.steps += 1

    def after(self, slot: int) -> object | None:
        """None, the first mark after the slot's last reader, or QUEUED."""
        last = self.last_read.get(slot)
        if last is None:
            return None
        return next((mark for before, mark in self.marks if before > last), QUEUED)


class SlotCopies:
    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.reads = SlotReads()

    def step(self, slots: Iterable[int]) -> None:
        if self.stream is not None:
            self.reads.step(slots, lambda: torch.cuda.current_stream(self.device).record_event())

    def run(self, slot: int, copy: Callable[[], None]) -> torch.cuda.Event | None:
        if self.stream is None:
            copy()
            return None
        after = self.reads.after(slot)
        if after is QUEUED:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        elif after is not None:
            self.stream.wait_event(after)
        with torch.cuda.stream(self.stream):
            copy()
            return self.stream.record_event()

    def done(self, event: torch.cuda.Event | None) -> bool:
        return event is None or event.query()

    def wait(self, event: torch.cuda.Event | None) -> None:
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
