"""The CUDA driver calls torch does not expose (libcuda through ctypes): an SM split into two
disjoint green contexts, their streams, the context stack."""

from __future__ import annotations

import ctypes


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
