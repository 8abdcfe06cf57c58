"""One engine process and its two ZeroMQ sockets, from spawn to reaped exit.

``start`` spawns ``engine_proc.run_engine`` and waits for its ``Ready`` (or its
``Failed``, or its exit). ``exited`` resolves with the exit code once the process is
gone *and reaped* (never a zombie). ``stop`` asks politely, then kills; both end in a
join. A restart is a new ``EngineLink``: sockets live in a per-link temporary directory.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import shutil
import tempfile
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from expresslane.child_process import stop_signals_blocked
from expresslane.server.engine_proc import run_engine
from expresslane.server.wire import Failed, FromEngine, Ready, Shutdown, ToEngine

log = logging.getLogger(__name__)

_FAILED_START_GRACE_S = 1.0  # after the engine exits while starting, wait this long for its Failed message
_STOP_GRACE_S = 5.0  # after Shutdown, before the kill


class EngineStartError(RuntimeError):
    """The engine process failed to start (its message, or its exit code)."""


class EngineLink:
    def __init__(self, engine_kwargs: dict[str, Any], log_level: str, profile_dir: str | None = None):
        self._kwargs = engine_kwargs
        self._log_level = log_level
        self._profile_dir = profile_dir
        self._encode = msgspec.msgpack.Encoder().encode
        self._decode = msgspec.msgpack.Decoder(FromEngine).decode
        self._proc: multiprocessing.Process | None = None
        self._sockets: list[zmq.Socket] = []
        self._contexts: list[zmq.Context] = []
        self._tmp: str | None = None
        self.exited: asyncio.Future[int | None] | None = None

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    async def start(self) -> Ready:
        loop = asyncio.get_running_loop()
        # Unique socket names per link: two servers (or two engines of one) never collide.
        self._tmp = tempfile.mkdtemp(prefix="expresslane-")
        in_addr, out_addr = f"ipc://{self._tmp}/to-engine", f"ipc://{self._tmp}/from-engine"
        ctx, actx = zmq.Context(), zmq.asyncio.Context()
        self._contexts = [ctx, actx]
        self._out = actx.socket(zmq.PULL)
        self._in = ctx.socket(zmq.PUSH)
        self._sockets = [self._in, self._out]
        self._out.bind(out_addr)
        self._in.setsockopt(zmq.SNDHWM, 0)  # never drop or block: admission control bounds the backlog
        self._in.connect(in_addr)  # the connecting side queues messages until the engine binds
        # The engine shares the CPU with this process: OpenMP threads that spin after every
        # parallel region (the default) steal it and stretch HTTP latency under load. The
        # spawned engine inherits the environment; a user's own setting wins.
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        proc = multiprocessing.get_context("spawn").Process(
            target=run_engine, args=(self._kwargs, in_addr, out_addr, self._log_level, self._profile_dir),
            name="expresslane-engine", daemon=True)
        with stop_signals_blocked():  # the engine never sees the group's SIGTERM (child_process.py)
            proc.start()
        self._proc = proc
        self.exited = loop.create_future()
        loop.add_reader(self._proc.sentinel, self._on_exit)
        recv = asyncio.ensure_future(self._out.recv())
        await asyncio.wait({recv, self.exited}, return_when=asyncio.FIRST_COMPLETED)
        if not recv.done():
            try:
                await asyncio.wait_for(recv, _FAILED_START_GRACE_S)
            except TimeoutError:
                raise EngineStartError(f"the engine process exited with code {self.exited.result()} "
                                       "while starting") from None
        msg = self._decode(recv.result())
        if isinstance(msg, Failed):
            raise EngineStartError(f"the engine failed to start: {msg.message}")
        if not isinstance(msg, Ready):
            raise EngineStartError(f"the engine sent {type(msg).__name__} before Ready")
        return msg

    def _on_exit(self) -> None:
        proc = self._proc
        asyncio.get_running_loop().remove_reader(proc.sentinel)
        # The sentinel turns readable while the process exits, maybe before it can be
        # waited for: join in a thread (it returns at once or within moments) to reap it.
        task = asyncio.ensure_future(asyncio.to_thread(proc.join))
        task.add_done_callback(lambda _: self.exited.done() or self.exited.set_result(proc.exitcode))

    def send(self, *msgs: ToEngine) -> None:
        """Send messages in order; all are encoded before any is sent (a value the wire format
        cannot carry raises with nothing sent)."""
        for frame in [self._encode(m) for m in msgs]:
            self._in.send(frame)

    async def recv(self):
        """The next message from the engine, decoded (raises msgspec errors on a corrupt one)."""
        return self._decode(await self._out.recv())

    def kill(self) -> None:
        if self._proc is not None and self._proc.is_alive():
            self._proc.kill()

    async def stop(self) -> int | None:
        """Stop the engine (Shutdown, then SIGKILL after a grace period), reap it, free the sockets."""
        proc = self._proc
        if proc is not None:  # started: `exited` exists
            if not self.exited.done():
                try:
                    self.send(Shutdown())
                except zmq.ZMQError:
                    pass
                await asyncio.wait({self.exited}, timeout=_STOP_GRACE_S)
            if not self.exited.done():
                proc.kill()
                await self.exited
        for sock in self._sockets:
            sock.close(linger=0)
        for ctx in self._contexts:
            ctx.term()
        self._sockets, self._contexts = [], []
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None
        return None if proc is None else proc.exitcode
