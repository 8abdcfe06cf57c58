"""After a large response the API process hands freed pages back (malloc_trim in a worker thread)."""

from __future__ import annotations

import asyncio
import threading

from expresslane.server import memory


def test_trims_run_off_the_loop_one_at_a_time_and_coalesce(monkeypatch):
    calls: list[tuple[int, bool]] = []
    release = threading.Event()

    def fake_trim(pad: int) -> int:
        calls.append((pad, threading.current_thread() is threading.main_thread()))
        release.wait(10)
        return 1

    monkeypatch.setattr(memory, "_trim", fake_trim)
    monkeypatch.setattr(memory, "_state", {"task": None, "again": False})

    async def main():
        memory.trim_soon()
        await asyncio.sleep(0)  # the first trim starts (and blocks its worker thread)
        for _ in range(5):  # asked again meanwhile: one more trim after it, not five
            memory.trim_soon()
        release.set()
        await memory._state["task"]

    asyncio.run(main())
    assert calls == [(0, False), (0, False)]


def test_glibc_malloc_trim_is_found_here():
    assert memory._trim is not None  # this machine and the GPU machine run glibc


def test_idle_trim_once_after_each_busy_period(monkeypatch):
    trims: list[int] = []
    monkeypatch.setattr(memory, "trim_soon", lambda: trims.append(state["admitted"]))
    state = {"in_flight": 0, "admitted": 0}
    idle = memory.IdleTrim(lambda: state["in_flight"], lambda: state["admitted"])
    idle.check()
    assert trims == []  # nothing served yet: nothing to give back
    state.update(in_flight=2, admitted=2)
    idle.check()
    assert trims == []  # busy
    state["in_flight"] = 0
    idle.check()
    idle.check()
    assert trims == [2]  # once, when it went idle
    state["admitted"] = 3  # a request came and went between two checks
    idle.check()
    assert trims == [2, 3]


def test_tune_allocator_sets_glibcs_thresholds():
    assert memory.tune_allocator() is True  # mallopt returns 1 for each accepted setting
