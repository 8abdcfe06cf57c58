"""LoRA slot loads on a side stream, each after the steps queued so far (they may read its
slot); inline on the host."""

from __future__ import annotations

from collections.abc import Callable

import torch


class SlotCopies:
    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def run(self, copy: Callable[[], None]) -> torch.cuda.Event | None:
        if self.stream is None:
            copy()
            return None
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            copy()
            return self.stream.record_event()

    def done(self, event: torch.cuda.Event | None) -> bool:
        return event is None or event.query()

    def wait(self, event: torch.cuda.Event | None) -> None:
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
