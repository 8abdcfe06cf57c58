"""Giving the API process's freed memory back to the OS.

A response of many tokens × logprobs allocates tens of MB of small dicts and floats for a
moment (``n=128, logprobs=20``, 64 tokens: 172,000 logprobs). Python frees them by refcount
(the request's output objects hold no reference cycles, so no full collection is needed),
but glibc's malloc keeps the freed pages in its arenas (one per thread that allocated; large
responses are built in worker threads). After such a response, ``malloc_trim(0)`` hands the
free pages back. It runs in a worker thread: a ctypes call releases the GIL, so the event
loop keeps serving meanwhile.

Two more habits of glibc's allocator made a long-running server's RSS creep:

- its mmap threshold rises to the size of the largest block freed so far (up to 32 MiB), so
  after one multi-MB request body every later one is carved from the heap and leaves holes
  there. ``tune_allocator`` fixes the threshold (which turns the rise off) and caps the arenas;
- free pages inside the heap stay resident until ``malloc_trim``. ``IdleTrim`` trims once
  the server has served something and then gone idle.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
from typing import Callable

LARGE_ITEMS = 20_000  # tokens × (1 + logprobs) of a response that is "large": built off the loop, then trimmed


MMAP_THRESHOLD = 256 * 1024  # bytes: blocks this large or larger get their own mapping, unmapped when freed
ARENA_MAX = 2  # malloc arenas; the API process's threads mostly wait for the GIL, so contention is moot
_M_MMAP_THRESHOLD, _M_ARENA_MAX = -3, -8  # glibc's mallopt parameter numbers (malloc.h)


def _libc_function(name: str):
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
    except OSError:
        return None
    return getattr(libc, name, None)  # glibc only (not musl, not macOS)


_trim = _libc_function("malloc_trim")
_mallopt = _libc_function("mallopt")


def tune_allocator() -> bool:
    """Fix glibc's mmap threshold and cap its arenas; call before the process starts threads.
    Returns whether both settings took (False where the C library is not glibc)."""
    if _mallopt is None:
        return False
    return bool(_mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(_mallopt(_M_ARENA_MAX, ARENA_MAX))


class IdleTrim:
    """Trim once after each busy period: ``check`` (called every second or so) trims when
    nothing is in flight and a request was admitted since the last trim."""

    def __init__(self, in_flight: Callable[[], int], admitted: Callable[[], int]):
        self._in_flight = in_flight
        self._admitted = admitted
        self._trimmed_after = 0

    def check(self) -> None:
        admitted = self._admitted()
        if admitted != self._trimmed_after and self._in_flight() == 0:
            self._trimmed_after = admitted
            trim_soon()


_state = {"task": None, "again": False}


def trim_soon() -> None:
    """Trim in a worker thread: one at a time, and once more after it when asked meanwhile."""
    if _trim is None:
        return
    task = _state["task"]
    if task is not None and not task.done():
        _state["again"] = True
        return
    _state["task"] = asyncio.get_running_loop().create_task(_trim_until_quiet())


async def _trim_until_quiet() -> None:
    while True:
        _state["again"] = False
        await asyncio.to_thread(_trim, 0)
        if not _state["again"]:
            return
