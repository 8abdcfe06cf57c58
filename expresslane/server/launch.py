"""Run the server: engine process + uvicorn, and the SIGTERM drain.

On the first SIGTERM (or Ctrl-C) the server stops admitting (503, ``/health`` 503) and
lets in-flight requests finish for up to ``--shutdown-timeout`` seconds. Past it, every
request still in flight ends with an error (a stream: an SSE error event and
``[DONE]``); then uvicorn and the engine process stop and the process exits 0 (1 when
the engine died on the way). A second signal stops the wait.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from dataclasses import replace

import uvicorn

from expresslane.config import EngineConfig
from expresslane.config.server import ServerConfig
from expresslane.server.admission import AdmissionLimits
from expresslane.server.api import build_app
from expresslane.server.batch_routes import BatchService, batch_service
from expresslane.server.engine_client import EngineClient
from expresslane.server.gpu_metrics import GpuSampler
from expresslane.server.memory import IdleTrim, tune_allocator
from expresslane.server.metrics import Metrics

log = logging.getLogger(__name__)

_FLUSH_S = 0.5  # past the shutdown timeout: how long the ended requests' responses may take to be written
# The most bytes of request line + headers h11 buffers before it answers 400 and closes (vLLM's
# default too). h11 checks its own 16 KiB default only while a request head is still incomplete,
# so a 64 kB header got a 401 or a 400 by how TCP happened to split it; past this limit the answer
# is always 400, and the client may see a reset for the bytes it was still sending.
MAX_HEADER_BYTES = 4 * 1024 * 1024
IDLE_TRIM_TICKS = 10  # uvicorn ticks (0.1 s each) between checks for an idle server to trim


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, client: EngineClient, shutdown_timeout: float):
        super().__init__(config)
        self.client = client
        self.shutdown_timeout = shutdown_timeout
        self.exit_code = 0
        self._drain_deadline: float | None = None
        self._drain_logged = False
        self._ended_at: float | None = None  # when the requests left at the deadline were failed
        self._idle_trim = IdleTrim(lambda: client.num_inflight, lambda: client.num_admitted)

    def handle_exit(self, sig: int, frame) -> None:
        # A signal handler: only set flags here; on_tick (every 0.1 s) does the work. Not
        # recording the signal also stops uvicorn from re-raising it after a clean exit.
        if self._drain_deadline is None and self.client.state == "ready":
            self._drain_deadline = time.monotonic() + self.shutdown_timeout
            self.client.start_draining()
        else:  # not serving yet, or a second signal
            self.force_exit = self.should_exit  # a third one skips uvicorn's graceful close too
            self.should_exit = True

    async def on_tick(self, counter: int) -> bool:
        if counter % IDLE_TRIM_TICKS == 0:
            self._idle_trim.check()
        if self._drain_deadline is not None:
            if not self._drain_logged:
                log.warning("shutting down: waiting up to %gs for %d in-flight requests", self.shutdown_timeout,
                            self.client.num_inflight)
                self._drain_logged = True
            if self.client.num_inflight == 0 and self._ended_at is None:
                return True
            now = time.monotonic()
            if self._ended_at is None and now >= self._drain_deadline:
                n = self.client.end_in_flight(f"the server shut down before this request finished "
                                              f"(--shutdown-timeout {self.shutdown_timeout:g} s)")
                log.warning("shutdown timeout (%g s) reached: ended %d requests still in flight with an error",
                            self.shutdown_timeout, n)
                self._ended_at = now
            # Their responses (error events) are written within a tick or two; then uvicorn stops.
            if self._ended_at is not None and (not self.server_state.tasks or now - self._ended_at > _FLUSH_S):
                return True
        return await super().on_tick(counter)


def serve(settings: ServerConfig, engine_kwargs: dict, log_level: str) -> int:
    """Run ``expresslane serve`` with these settings (validated) and engine flags (the model included)."""
    settings = replace(settings, served_model_name=settings.model_name(engine_kwargs.get("model")))
    tune_allocator()  # before any thread starts
    lanes = EngineConfig.from_kwargs(**engine_kwargs).scheduler.lane_slo
    log_level = log_level.upper()
    metrics = Metrics(settings.served_model_name, lanes)
    admission = settings.admission
    limits = AdmissionLimits(admission.max_waiting_requests, admission.max_waiting_tokens,
                             lanes["interactive"].ttft if admission.slo_admission else None,
                             {lane: slo.queue for lane, slo in lanes.items()})
    profile_dir = None
    if settings.profile_dir is not None:
        profile_dir = os.path.abspath(settings.profile_dir)
        try:
            os.makedirs(profile_dir, exist_ok=True)
        except OSError as e:  # before any process starts
            raise ValueError(f"--profile-dir {settings.profile_dir!r}: cannot create it ({e.strerror})") from None
        if not os.access(profile_dir, os.W_OK):
            raise ValueError(f"--profile-dir {settings.profile_dir!r}: not writable")
    client = EngineClient(engine_kwargs, metrics, limits, log_level, settings.engine_restarts, profile_dir)
    batches = batch_service(settings.batch, metrics.registry, settings.served_model_name)
    host, port = settings.listen.host, settings.listen.port
    config = uvicorn.Config(build_app(client, settings, metrics, batches), host=host, port=port,
                            log_level=log_level.lower(), access_log=log_level in ("DEBUG", "INFO"), lifespan="off",
                            timeout_graceful_shutdown=_FLUSH_S,
                            h11_max_incomplete_event_size=MAX_HEADER_BYTES)
    server = DrainingServer(config, client, settings.shutdown_timeout)
    gpu = GpuSampler(metrics)
    if engine_kwargs.get("device") != "cpu":
        gpu.start()
    try:
        # uvicorn's loop choice: uvloop when installed (uvicorn[standard]), as `uvicorn.run` would.
        with asyncio.Runner(loop_factory=config.get_loop_factory()) as runner:
            code = runner.run(_serve(server, client, settings, batches))
    finally:
        gpu.stop()
    # Everything is closed and the engine reaped. The interpreter's own teardown (torch,
    # transformers) takes seconds on a busy machine: skip it, so the process exits now.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


async def _serve(server: DrainingServer, client: EngineClient, settings: ServerConfig,
                 batches: BatchService | None) -> int:
    def announce() -> None:
        if batches is not None:  # batch work starts once the engine is ready
            batches.start(server.config.app)
        print(f"expresslane: serving {settings.served_model_name!r} on http://{settings.listen.host}:"
              f"{settings.listen.port}",
              file=sys.stderr, flush=True)

    def ended(task: asyncio.Task) -> None:
        if task.cancelled():
            return
        if task.exception() is not None:  # the first start failed
            print(f"error: {task.exception()}", file=sys.stderr)
        if task.exception() is not None or client.state == "dead":
            server.exit_code = 1
            server.should_exit = True

    # The port opens at once (/health says 503 "starting") while the engine loads.
    engine = asyncio.create_task(client.run(announce))
    engine.add_done_callback(ended)
    try:
        await server.serve()
    finally:
        engine.cancel()
        if batches is not None:
            await batches.stop()  # unanswered batch requests go back to the queue
        await client.close()
    return 1 if client.engine_failed else server.exit_code
