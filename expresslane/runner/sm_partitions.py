"""The two lanes' steps on disjoint sets of SMs (docs/architecture.md, "Prefill and decode side by
side"): one driver split per decode-SM count, each half a green context with its own stream.

torch's `GreenContext.create` carves every context from the whole device, so two of them share
SMs and their kernels do not overlap; one `cuDevSmResourceSplitByCount` gives an N-SM group and
its exact remainder. The driver calls go through ctypes (torch does not expose them)."""

from __future__ import annotations

import contextlib
import ctypes
import logging

import torch

from expresslane.device import scratch_set

log = logging.getLogger(__name__)


class Driver:
    """libcuda calls: an SM split into two disjoint green contexts, their streams, the context stack."""

    SM_RESOURCE = 1  # CU_DEV_RESOURCE_TYPE_SM
    RESOURCE_BYTES = 512  # a CUdevResource is 144 bytes in CUDA 12.4-13.0 (more later): room to spare
    SM_COUNT_AT = 96  # CUdevResource.sm.smCount: after the 4-byte type and 92 bytes of padding
    NON_BLOCKING = 1  # CU_STREAM_NON_BLOCKING: no implicit sync with a legacy default stream

    def __init__(self):
        self.lib = ctypes.CDLL("libcuda.so.1")
        self("cuInit", ctypes.c_uint(0))

    def __call__(self, name: str, *args) -> None:
        rc = getattr(self.lib, name)(*args)
        if rc:
            text = ctypes.c_char_p()
            self.lib.cuGetErrorString(rc, ctypes.byref(text))
            raise RuntimeError(f"{name}: CUresult {rc} ({(text.value or b'?').decode()})")

    def version(self) -> int:
        v = ctypes.c_int()
        self("cuDriverGetVersion", ctypes.byref(v))
        return v.value

    def sm_count(self, resource) -> int:
        return int.from_bytes(resource.raw[self.SM_COUNT_AT:self.SM_COUNT_AT + 4], "little")

    def split(self, n: int, device: int = 0) -> tuple[list[tuple[int, int, int]], int]:
        """Green contexts on n SMs and on the rest of the device, from one split: [(green
        context, its CUcontext, SMs granted)] x 2, and the device's SMs as the driver counts them
        (equal to multi_processor_count when SM_COUNT_AT reads this driver's layout)."""
        dev = ctypes.c_int()
        self("cuDeviceGet", ctypes.byref(dev), ctypes.c_int(device))
        whole, group, rest = (ctypes.create_string_buffer(self.RESOURCE_BYTES) for _ in range(3))
        self("cuDeviceGetDevResource", dev, whole, ctypes.c_int(self.SM_RESOURCE))
        groups = ctypes.c_uint(1)
        self("cuDevSmResourceSplitByCount", group, ctypes.byref(groups), whole, rest, ctypes.c_uint(0),
             ctypes.c_uint(n))
        made = []
        for resource in (group, rest):
            desc, green, ctx = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
            self("cuDevResourceGenerateDesc", ctypes.byref(desc), resource, ctypes.c_uint(1))
            self("cuGreenCtxCreate", ctypes.byref(green), desc, dev, ctypes.c_uint(1))  # CU_GREEN_CTX_DEFAULT_STREAM
            self("cuCtxFromGreenCtx", ctypes.byref(ctx), green)
            made.append((green.value, ctx.value, self.sm_count(resource)))
        return made, self.sm_count(whole)

    def green_stream(self, green: int, priority: int = 0) -> int:
        s = ctypes.c_void_p()
        self("cuGreenCtxStreamCreate", ctypes.byref(s), ctypes.c_void_p(green), ctypes.c_uint(self.NON_BLOCKING),
             ctypes.c_int(priority))
        return s.value

    def stream_here(self, priority: int = 0) -> int:
        """A stream of whatever context is current."""
        s = ctypes.c_void_p()
        self("cuStreamCreateWithPriority", ctypes.byref(s), ctypes.c_uint(self.NON_BLOCKING), ctypes.c_int(priority))
        return s.value

    def green_of(self, stream: int) -> int:
        """The green context a stream belongs to (0: none, i.e. the primary context)."""
        g = ctypes.c_void_p()
        self("cuStreamGetGreenCtx", ctypes.c_void_p(stream), ctypes.byref(g))
        return g.value or 0

    def push(self, ctx: int) -> None:
        self("cuCtxPushCurrent_v2", ctypes.c_void_p(ctx))

    def pop(self) -> None:
        self("cuCtxPopCurrent_v2", ctypes.byref(ctypes.c_void_p()))


class SmPartitions:
    """Each lane's stream for a step: a split's decode or prefill half while both lanes run
    (`sms`: the split's decode SMs), else the lane's own stream in the primary context (every SM).

    A lane's steps stay in order when its stream changes: the new stream waits for the lane's last
    step (an event, no host sync). The two lanes are not ordered against each other: the engine
    hands a request to the other lane only after its step has landed. `barrier` orders both ways,
    for state tensors both lanes use and one step may replace (penalty and bad-word rows)."""

    def __init__(self, device: torch.device, decode_sms: list[int], push: bool = False):
        self.driver = Driver()
        self.device, self.push = device, push
        self.total = torch.cuda.get_device_properties(device).multi_processor_count
        self._alone = {lane: torch.cuda.Stream(device) for lane in ("decode", "prefill")}
        self._halves: dict[int, dict[str, tuple[torch.cuda.ExternalStream, int]]] = {}
        self.granted: dict[int, tuple[int, int]] = {}
        for n in sorted(set(decode_sms)):
            made, counted = self.driver.split(n, device.index or 0)
            streams = [torch.cuda.ExternalStream(self.driver.green_stream(green), device) for green, _, _ in made]
            self._halves[n] = {lane: (s, ctx) for lane, s, (_, ctx, _) in zip(("decode", "prefill"), streams, made)}
            self.granted[n] = (made[0][2], made[1][2]) if counted == self.total else (n, self.total - n)
        self._last: dict[str, tuple[torch.cuda.Stream, torch.cuda.Event]] = {}  # lane -> its last step's
        self._after: dict[str, str] = {}  # lane -> the lane whose last step its next one waits for

    def stream(self, lane: str, sms: int) -> torch.cuda.Stream:
        return self._alone[lane] if not sms else self._halves[sms][lane][0]

    @contextlib.contextmanager
    def running(self, lane: str, sms: int, carried: list[torch.Tensor | None]):
        """Launches inside go to the lane's stream; `carried`: the lane's tensors from its previous
        step, kept from reuse until this step has read them. The prefill lane has arrival counters
        and scratch of its own (the decode lane's graphs hold the default set)."""
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
        ctx = self._halves[sms][lane][1] if sms and self.push else None
        if ctx is not None:
            self.driver.push(ctx)
        try:
            with torch.cuda.stream(stream), scratch_set(lane if lane == "prefill" else None):
                yield
        finally:
            if ctx is not None:
                self.driver.pop()
            event = torch.cuda.Event()
            event.record(stream)
            self._last[lane] = (stream, event)

    def barrier(self, lane: str) -> None:
        """Inside `running(lane)`: what follows waits for the other lane's steps so far, and the
        other lane's next step waits for this one."""
        other = "prefill" if lane == "decode" else "decode"
        last = self._last.get(other)
        if last is not None:
            torch.cuda.current_stream(self.device).wait_event(last[1])
        self._after[other] = lane

    def describe(self) -> str:
        return ", ".join(f"{d}/{p}" for d, p in self.granted.values())


def bind(device: torch.device, decode_sms: list[int], push: bool = False) -> SmPartitions | None:
    """The partitions, or None (logged) where the driver cannot split this device's SMs."""
    try:
        parts = SmPartitions(device, decode_sms, push)
    except (OSError, AttributeError, RuntimeError) as e:  # no libcuda, no green-context API, a refused split
        log.warning("pd_lanes: no SM partitions (%s); the lanes take turns on one stream", e)
        return None
    log.info("pd_lanes: SM partitions decode/prefill %s of %d SMs", parts.describe(), parts.total)
    return parts
