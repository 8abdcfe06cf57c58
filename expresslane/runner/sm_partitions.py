"""Each lane's steps on its own SMs (docs/architecture.md, "side by side")."""

from __future__ import annotations

import contextlib
import logging

import torch

from expresslane.cuda_driver import Driver
from expresslane.device import scratch_set

log = logging.getLogger(__name__)


class SmPartitions:
    """A lane's stream: its split's half (`sms`: decode SMs), else its own on every SM."""

    def __init__(self, device: torch.device, decode_sms: list[int]):
        self.driver = Driver()
        self.device = device
        self.total = torch.cuda.get_device_properties(device).multi_processor_count
        self._alone = {lane: torch.cuda.Stream(device) for lane in ("decode", "prefill")}
        self._halves: dict[int, dict[str, torch.cuda.ExternalStream]] = {}
        self.granted: dict[int, tuple[int, int]] = {}
        for n in sorted(set(decode_sms)):
            made, counted = self.driver.split(n, device.index or 0)
            streams = [torch.cuda.ExternalStream(self.driver.green_stream(green), device) for green, _, _ in made]
            self._halves[n] = dict(zip(("decode", "prefill"), streams))
            self.granted[n] = (made[0][2], made[1][2]) if counted == self.total else (n, self.total - n)
        self._last: dict[str, tuple[torch.cuda.Stream, torch.cuda.Event]] = {}
        self._after: dict[str, str] = {}  # lane -> the lane it waits for

    def stream(self, lane: str, sms: int) -> torch.cuda.Stream:
        return self._alone[lane] if not sms else self._halves[sms][lane]

    @contextlib.contextmanager
    def running(self, lane: str, sms: int, carried: list[torch.Tensor | None]):
        """`carried`: the lane's tensors from its last step."""
        stream = self.stream(lane, sms)
        last = self._last.get(lane)
        if last is not None and last[0] is not stream:
            stream.wait_event(last[1])
            for t in carried:
                if t is not None:
                    t.record_stream(stream)
        after = self._after.pop(lane, None)
        if after is not None:
            stream.wait_event(self._last[after][1])
        try:
            with torch.cuda.stream(stream), scratch_set(lane if lane == "prefill" else None):
                yield
        finally:
            event = torch.cuda.Event()
            event.record(stream)
            self._last[lane] = (stream, event)

    def barrier(self, lane: str) -> None:
        """Wait for the other lane's steps; its next waits for this."""
        other = "prefill" if lane == "decode" else "decode"
        last = self._last.get(other)
        if last is not None:
            torch.cuda.current_stream(self.device).wait_event(last[1])
        self._after[other] = lane

    def describe(self) -> str:
        return ", ".join(f"{d}/{p}" for d, p in self.granted.values())


def bind(device: torch.device, decode_sms: list[int]) -> SmPartitions | None:
    try:
        parts = SmPartitions(device, decode_sms)
    except (OSError, AttributeError, RuntimeError) as e:  # no libcuda or green contexts, a refused split
        log.warning("pd_lanes: no SM partitions (%s); the lanes take turns on one stream", e)
        return None
    log.info("pd_lanes: SM partitions decode/prefill %s of %d SMs", parts.describe(), parts.total)
    return parts
