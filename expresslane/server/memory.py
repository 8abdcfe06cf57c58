"""Giving the memory of a large response back to the OS.

A response of many tokens × logprobs allocates tens of MB of small dicts and floats for a
moment (``n=128, logprobs=20``, 64 tokens: 172,000 logprobs). Python frees them by refcount
(the request's output objects hold no reference cycles, so no full collection is needed),
but glibc's malloc keeps the freed pages in its arenas (one per thread that allocated; large
responses are built in worker threads). After such a response, ``malloc_trim(0)`` hands the
free pages back. It runs in a worker thread: a ctypes call releases the GIL, so the event
loop keeps serving meanwhile.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util

LARGE_ITEMS = 20_000  # tokens × (1 + logprobs) of a response that is "large": built off the loop, then trimmed


def _malloc_trim():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
    except OSError:
        return None
    return getattr(libc, "malloc_trim", None)  # glibc only (not musl, not macOS)


_trim = _malloc_trim()
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
