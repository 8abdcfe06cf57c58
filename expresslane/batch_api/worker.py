"""BatchWorker: drains a store through an executor, at most ``concurrency`` requests at a time.

It claims requests with a lease, renews the leases of those still running (every
third of the lease), writes each result once, and finishes batches when they are done.
When the executor says the server is busy (``Outcome.retry_after``) the request goes
back to the queue unanswered and the worker pauses claiming for that long. A worker
that dies holds nothing for longer than its lease.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass
from typing import Awaitable, Callable

from expresslane.batch_api.records import BatchRecord, Item, ItemResult
from expresslane.batch_api.store import BatchStore

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Outcome:
    """A result to write, or ``retry_after`` seconds to wait before the request may run again."""

    result: ItemResult | None = None
    retry_after: float | None = None


Executor = Callable[[Item], Awaitable[Outcome]]


def worker_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class BatchWorker:
    def __init__(self, store: BatchStore, execute: Executor, *, concurrency: int, lease: float, poll: float,
                 name: str | None = None, clock: Callable[[], float] = time.time,
                 on_result: Callable[[Item, ItemResult], None] | None = None,
                 on_sweep: Callable[[list[BatchRecord]], None] | None = None):
        if concurrency < 1 or lease <= 0 or poll <= 0:
            raise ValueError("concurrency, lease and poll must be positive")
        self.store, self.execute = store, execute
        self.concurrency, self.lease, self.poll = concurrency, lease, poll
        self.name = name or worker_name()
        self.clock = clock
        self.on_result = on_result  # after each result this worker wrote
        self.on_sweep = on_sweep  # every poll interval, with the unfinished batches (progress)
        self._running: dict[asyncio.Task, Item] = {}
        self._resume_at = 0.0  # no claims before this (the server said it is busy)
        self._wrote = False  # a result was written since the last finalize sweep

    @property
    def num_running(self) -> int:
        return len(self._running)

    async def _store(self, fn, *args):
        return await asyncio.to_thread(fn, *args)

    async def run(self) -> None:
        """Work until cancelled; on cancellation the unanswered requests go back to the queue."""
        renew_at = sweep_at = 0.0
        try:
            while True:
                now = self.clock()
                free = self.concurrency - len(self._running)
                if free > 0 and now >= self._resume_at:
                    for item in await self._store(self.store.claim, self.name, free, self.lease, now):
                        self._running[asyncio.create_task(self._one(item))] = item
                if self._running and now >= renew_at:
                    await self._store(self.store.renew, self.name, list(self._running.values()), self.lease, now)
                    renew_at = now + self.lease / 3
                if self._wrote or now >= sweep_at:
                    self._wrote = False
                    for batch_id in await self._store(self.store.finalize_due, int(now), self.lease):
                        log.info("batch %s finished", batch_id)
                    if now >= sweep_at and self.on_sweep is not None:
                        self.on_sweep(await self._store(self.store.open_batches))
                    sweep_at = now + self.poll
                await self._wait(now)
        finally:
            await self._give_back()

    async def _wait(self, now: float) -> None:
        """Until a request finishes (a seat is free) or the poll interval (or the pause) passes."""
        timeout = self.poll if self._resume_at <= now else min(self.poll, self._resume_at - now)
        if self._running:
            await asyncio.wait(list(self._running), timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        else:
            await asyncio.sleep(timeout)

    async def _one(self, item: Item) -> None:
        try:
            try:
                outcome = await self.execute(item)
            except Exception as e:  # the executor's own failure (not the request's): try again later
                log.warning("batch %s request %r: %r; retrying", item.batch_id, item.custom_id, e)
                outcome = Outcome(retry_after=self.poll)
            if outcome.result is None:
                self._resume_at = max(self._resume_at, self.clock() + (outcome.retry_after or self.poll))
                await self._store(self.store.release, self.name, [item])
                return
            if await self._store(self.store.complete, item, outcome.result):
                self._wrote = True
                if self.on_result is not None:
                    self.on_result(item, outcome.result)
        finally:
            self._running.pop(asyncio.current_task(), None)

    async def _give_back(self) -> None:
        tasks, items = list(self._running), list(self._running.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if items:
            try:
                await asyncio.shield(self._store(self.store.release, self.name, items))
            except Exception:  # the store is gone: the leases run out instead
                log.exception("could not give back %d batch requests", len(items))
