"""LoRA slot loads on a side stream; inline on the host.

A load overwrites its slot, so it must wait for the queued steps that read the slot's previous
adapter, and only for those: a slot whose last reader has run (the usual case, an LRU victim)
starts loading at once, beside the step in flight, instead of when every queued step has run.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable

import torch

QUEUED = "all"  # SlotReads.after: every step queued so far


class SlotReads:
    """Which queued steps read each slot, and marks (events the caller records on the compute
    stream) after which a set of steps has run: pure bookkeeping, no device."""

    KEEP = 8  # marks kept: a later mark also covers an earlier one's steps

    def __init__(self):
        self.steps = 0  # steps queued so far
        self.last_read: dict[int, int] = {}  # slot -> the step that last read it
        self.latest = -1  # the latest step that read any slot
        self.marks: deque[tuple[int, object]] = deque(maxlen=self.KEEP)  # (steps queued before it, its mark)

    def step(self, slots: Iterable[int], mark: Callable[[], object]) -> None:
        """A step is about to be queued, reading `slots`. `mark()` records a mark after the
        steps queued so far; it is called only when a read is not yet covered by one."""
        if self.latest >= 0 and (not self.marks or self.marks[-1][0] <= self.latest):
            self.marks.append((self.steps, mark()))
        for slot in slots:
            self.last_read[slot] = self.steps
            self.latest = self.steps
        self.steps += 1

    def after(self, slot: int) -> object | None:
        """What a load into `slot` waits for: None (no step read it), the earliest mark after
        its last reader, or QUEUED (its reader is the step last queued, with no mark yet)."""
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
        """Before a step's kernels are queued: the slots it reads."""
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
