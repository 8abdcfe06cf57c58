"""EngineClient: the API process's side of the engine process.

It spawns the engine process, sends it tokenized requests and aborts, and turns the
token outputs it streams back into cumulative ``RequestOutput``s (detokenization and
stop strings happen here, in ``OutputProcessor``), delivered to one asyncio queue per
HTTP request. It also owns admission control and the server's life cycle state::

    starting -> ready -> draining -> stopped          (any of them -> dead when the engine dies)

A request id ``X`` with ``n > 1`` runs in the engine as ``X#0 .. X#{n-1}``.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import multiprocessing
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator

import msgspec
import zmq
import zmq.asyncio

from expresslane.engine.contract import EngineCoreOutput, EngineCoreRequest
from expresslane.engine.core import resolve_model_dir
from expresslane.engine.llm_engine import InputProcessor
from expresslane.engine.output_processor import OutputProcessor, child_params, child_request_ids
from expresslane.lanes import resolve_lane
from expresslane.models.loader import load_hf_config
from expresslane.outputs import RequestOutput
from expresslane.sampling_params import SamplingParams
from expresslane.server import errors
from expresslane.server.engine_proc import run_engine
from expresslane.server.metrics import Metrics
from expresslane.server.wire import Abort, Add, Failed, FromEngine, OutputId, OutputsIn, Profile, Profiled, Shutdown
from expresslane.tokenizer import eos_token_ids, load_tokenizer

log = logging.getLogger(__name__)

_FAILED_START_GRACE_S = 1.0  # after the engine exits while starting, wait this long for its Failed message


@dataclass(slots=True)
class Admission:
    """Caps on work admitted but not yet producing tokens (queued or in prefill); None = no cap."""

    max_waiting_requests: int | None = None
    max_waiting_tokens: int | None = None
    slo_ttft: float | None = None  # SLO admission: refuse interactive work that cannot start in time
    lane_queue: dict[str, int] = field(default_factory=dict)  # lane -> cap on its waiting requests (0: none)


@dataclass(slots=True)
class _Tracked:
    """API-side state of one request (all its n completions)."""

    queue: asyncio.Queue
    lane: str
    num_requests: int  # engine requests: n
    num_prompt_tokens: int  # counted n times, as the engine computes (or cache-hits) each child
    started: bool = False  # first token seen: no longer waiting
    num_tokens: int = 0
    last_token_time: float | None = None
    engine_arrival_time: float | None = None


@dataclass(slots=True)
class RequestGroup:
    """The outputs of one HTTP request: one or more prompts sharing a queue."""

    client: "EngineClient"
    tracked: dict[str, _Tracked]  # request id -> its state, kept after it finishes
    queue: asyncio.Queue
    deadline: float | None
    timeout: float | None

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        """Cumulative outputs until every prompt is finished; raises APIError on failure."""
        pending = set(self.tracked)
        while pending:
            try:
                if not self.queue.empty() or self.deadline is None:  # the common case: no timer task
                    item = await self.queue.get()
                else:
                    item = await asyncio.wait_for(self.queue.get(), self.deadline - time.monotonic())
            except TimeoutError:
                self.close()
                raise errors.request_timeout(self.timeout) from None
            if isinstance(item, errors.APIError):
                self.close()
                raise item
            if item.finished:
                pending.discard(item.request_id)
            yield item

    def close(self) -> None:
        """Abort whatever has not finished (client gone, timeout, error); idempotent."""
        for rid in self.tracked:
            self.client.abort(rid)

    def engine_arrival_time(self, request_id: str) -> float | None:
        """When the engine process took the request: the start of the engine's own TTFT."""
        return self.tracked[request_id].engine_arrival_time


class EngineClient:
    def __init__(self, engine_kwargs: dict[str, Any], metrics: Metrics, admission: Admission,
                 log_level: str = "WARNING", profile_dir: str | None = None):
        self.state = "starting"
        self.model_dir: Path | None = None
        self.max_model_len: int | None = None
        self.metrics = metrics
        self.admission = admission
        self._engine_kwargs = engine_kwargs
        self._log_level = log_level
        self._requests: dict[str, _Tracked] = {}
        self._waiting_requests = 0
        self._waiting_tokens = 0
        self._waiting_interactive_tokens = 0
        self._waiting_by_lane: dict[str, int] = {}
        self._prefill_rate: float | None = None  # tokens/s the engine's steps process (moving average)
        self._encode = msgspec.msgpack.Encoder().encode
        self._decode = msgspec.msgpack.Decoder(FromEngine).decode
        self._decode_output = msgspec.msgpack.Decoder(EngineCoreOutput).decode
        self._decode_id = msgspec.msgpack.Decoder(OutputId).decode
        self._proc: multiprocessing.Process | None = None
        self._reader: asyncio.Task | None = None
        self._sockets: list[zmq.Socket] = []
        self._contexts: list[zmq.Context] = []
        self._tmp: str | None = None
        self.profile_dir = profile_dir
        self._profile_replies: collections.deque[asyncio.Future] = collections.deque()  # the engine answers in order

    # -- life cycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        kwargs = dict(self._engine_kwargs)
        self.model_dir = await asyncio.to_thread(resolve_model_dir, kwargs.get("model"))  # may build the default
        kwargs["model"] = str(self.model_dir)
        # Unique socket names per server: two servers on one machine never collide.
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
        self._proc = multiprocessing.get_context("spawn").Process(
            target=run_engine, args=(kwargs, in_addr, out_addr, self._log_level, self.profile_dir),
            name="expresslane-engine", daemon=True)
        self._proc.start()
        self._exited = loop.create_future()
        loop.add_reader(self._proc.sentinel, self._on_engine_exit)
        frontend = asyncio.ensure_future(asyncio.to_thread(self._load_frontend))  # overlaps the engine's load
        ready = await self._wait_ready()
        tokenizer, vocab_size, eos = await frontend
        self.tokenizer = tokenizer
        self.max_model_len = ready.max_model_len
        self.num_kv_blocks = ready.num_kv_blocks
        self.inputs = InputProcessor(tokenizer, vocab_size, ready.max_model_len, eos)
        self.outputs = OutputProcessor(tokenizer)
        self._reader = asyncio.create_task(self._read_outputs())
        self.state = "ready"
        log.info("engine ready: %s, max_model_len %d, %d KV blocks", self.model_dir, self.max_model_len,
                 self.num_kv_blocks)

    def _load_frontend(self):
        config = load_hf_config(self.model_dir)
        tokenizer = load_tokenizer(self._engine_kwargs.get("tokenizer") or self.model_dir)
        return tokenizer, config.vocab_size, eos_token_ids(self.model_dir, config, tokenizer)

    async def _wait_ready(self):
        recv = asyncio.ensure_future(self._out.recv())
        await asyncio.wait({recv, self._exited}, return_when=asyncio.FIRST_COMPLETED)
        if not recv.done():
            try:
                await asyncio.wait_for(recv, _FAILED_START_GRACE_S)
            except TimeoutError:
                raise RuntimeError(f"the engine process exited with code {self._proc.exitcode} while starting") from None
        msg = self._decode(recv.result())
        if isinstance(msg, Failed):
            raise RuntimeError(f"the engine failed to start: {msg.message}")
        return msg

    def start_draining(self) -> None:
        if self.state == "ready":
            self.state = "draining"

    @property
    def num_inflight(self) -> int:
        return len(self._requests)

    async def close(self) -> None:
        """Stop the engine process (politely, then by force) and free the sockets."""
        proc, self._proc = self._proc, None
        if self.state != "dead":
            self.state = "stopped"
        if self._reader is not None:
            self._reader.cancel()
        if proc is not None:
            asyncio.get_running_loop().remove_reader(proc.sentinel)
            if proc.is_alive():
                self._in.send(self._encode(Shutdown()))
                await asyncio.to_thread(proc.join, 5)
            if proc.is_alive():
                proc.kill()
                await asyncio.to_thread(proc.join, 5)
        for sock in self._sockets:
            sock.close(linger=0)
        for ctx in self._contexts:
            ctx.term()
        self._sockets, self._contexts = [], []
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)

    def _on_engine_exit(self) -> None:
        loop = asyncio.get_running_loop()
        loop.remove_reader(self._proc.sentinel)
        self._proc.join(0)  # reap it; sets exitcode
        if not self._exited.done():
            self._exited.set_result(self._proc.exitcode)
        if self.state in ("ready", "draining"):
            self._die(f"the engine process exited unexpectedly (exit code {self._proc.exitcode})")

    def _die(self, why: str) -> None:
        """Fail every in-flight request now (no hang) and refuse new ones; /health turns 503."""
        log.error("%s; failing %d in-flight requests", why, len(self._requests))
        self.state = "dead"
        if self._reader is not None and self._reader is not asyncio.current_task():
            self._reader.cancel()
        for t in self._requests.values():
            t.queue.put_nowait(errors.engine_dead())
        self._requests.clear()
        self.outputs = OutputProcessor(self.tokenizer)
        self._waiting_requests = self._waiting_tokens = self._waiting_interactive_tokens = 0
        self._waiting_by_lane.clear()
        self.metrics.engine_stopped()
        while self._profile_replies:
            self._profile_replies.popleft().set_exception(errors.engine_dead())
        if self._proc is not None and self._proc.is_alive():
            self._proc.kill()

    async def profile(self, start: bool) -> Profiled:
        """Start or stop the engine's torch profiler (``--profile-dir``); raises APIError when refused."""
        if self.profile_dir is None:
            raise errors.APIError(404, "profiling is off: start the server with --profile-dir DIR",
                                  "not_found_error", None, "profiling_disabled")
        self.check_accepting()
        reply = asyncio.get_running_loop().create_future()
        self._profile_replies.append(reply)
        self._in.send(self._encode(Profile(start)))
        msg = await reply
        if msg.error is not None:
            raise errors.APIError(msg.status, msg.error, "invalid_request_error" if msg.status == 400
                                  else "internal_error", None, "profile_state" if msg.status == 400
                                  else "profile_failed")
        return msg

    # -- requests -----------------------------------------------------------------------------
    def check_accepting(self) -> None:
        if self.state == "ready":
            return
        if self.state == "starting":
            raise errors.unavailable("the server is starting", "starting")
        if self.state == "draining":
            raise errors.unavailable("the server is shutting down", "shutting_down")
        raise errors.unavailable("the engine is not running", "engine_dead", retry_after=None)

    def _admit(self, num_requests: int, num_tokens: int, lane: str) -> None:
        # An empty queue always admits, so a request bigger than a cap is not refused forever.
        if self._waiting_requests == 0:
            return
        a = self.admission
        cap = a.lane_queue.get(lane, 0)
        waiting = self._waiting_by_lane.get(lane, 0)
        if cap and waiting and waiting + num_requests > cap:
            raise errors.unavailable(f"the {lane} lane's queue is full ({waiting} requests waiting); retry later",
                                     "lane_queue_full")
        if a.slo_ttft is not None and lane == "interactive" and self._prefill_rate:
            # the interactive prefill ahead of this request, at the rate the engine processes tokens
            eta = (self._waiting_interactive_tokens + num_tokens) / self._prefill_rate
            if eta > a.slo_ttft:
                raise errors.unavailable(
                    f"the interactive lane cannot meet its TTFT target of {a.slo_ttft * 1e3:.0f} ms: "
                    f"about {eta * 1e3:.0f} ms of prompt processing is ahead of this request; retry later",
                    "slo_unattainable", retry_after=max(1, math.ceil(eta - a.slo_ttft)))
        if a.max_waiting_requests is not None and self._waiting_requests + num_requests > a.max_waiting_requests:
            raise errors.unavailable(f"the server is overloaded ({self._waiting_requests} requests waiting); "
                                     "retry later", "overloaded")
        if a.max_waiting_tokens is not None and self._waiting_tokens + num_tokens > a.max_waiting_tokens:
            raise errors.unavailable(f"the server is overloaded ({self._waiting_tokens} prompt tokens waiting); "
                                     "retry later", "overloaded")

    def submit(self, request_id: str, prompts: list[tuple[str | None, list[int]]], params: SamplingParams, *,
               priority: int, lane: str | None, timeout: float | None) -> RequestGroup:
        """Admit and send one HTTP request's prompts (already validated); raises APIError 503 when full."""
        self.check_accepting()
        lane = resolve_lane(lane, priority)
        n = params.n
        self._admit(n * len(prompts), n * sum(len(ids) for _, ids in prompts), lane)
        arrival = time.monotonic()
        rids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
        batch = [EngineCoreRequest(cid, ids, params if n == 1 else child_params(params, j), self.inputs.eos,
                                   arrival, priority, lane)
                 for rid, (_, ids) in zip(rids, prompts) for j, cid in enumerate(child_request_ids(rid, n))]
        message = self._encode(Add(batch))  # before any state changes: a failure here leaves no trace
        queue: asyncio.Queue = asyncio.Queue()
        tracked = {}
        for rid, (text, ids) in zip(rids, prompts):
            self.outputs.add_request(rid, text, ids, params, arrival)
            t = tracked[rid] = self._requests[rid] = _Tracked(queue, lane, n, n * len(ids))
            self._waiting_requests += t.num_requests
            self._waiting_tokens += t.num_prompt_tokens
            self._waiting_by_lane[lane] = self._waiting_by_lane.get(lane, 0) + t.num_requests
            if lane == "interactive":
                self._waiting_interactive_tokens += t.num_prompt_tokens
        self._in.send(message)
        return RequestGroup(self, tracked, queue, None if timeout is None else arrival + timeout, timeout)

    def abort(self, request_id: str) -> None:
        t = self._requests.pop(request_id, None)
        if t is None:
            return
        self._started(t)
        child_ids = self.outputs.child_ids(request_id)
        out = self.outputs.abort(request_id)
        if self.state in ("ready", "draining"):
            self._in.send(self._encode(Abort(child_ids)))
        if out is not None:
            self.metrics.finished(t.lane, out)

    def _started(self, t: _Tracked) -> None:
        if not t.started:
            t.started = True
            self._waiting_requests -= t.num_requests
            self._waiting_tokens -= t.num_prompt_tokens
            self._waiting_by_lane[t.lane] -= t.num_requests
            if t.lane == "interactive":
                self._waiting_interactive_tokens -= t.num_prompt_tokens

    # -- outputs ------------------------------------------------------------------------------
    async def _read_outputs(self) -> None:
        try:
            while True:
                msg = self._decode(await self._out.recv())
                if isinstance(msg, OutputsIn):
                    self._handle(msg)
                elif isinstance(msg, Profiled):
                    self._profile_replies.popleft().set_result(msg)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # an undecodable message or a bug here must not leave requests hanging
            log.exception("output loop failed")
            self._die(f"internal error in the output loop: {e!r}")

    def _fail(self, request_id: str, error: errors.APIError) -> None:
        """End one request with an error (its other prompts' and completions' work is aborted too)."""
        t = self._requests.get(request_id)
        if t is not None:
            self.abort(request_id)
            t.queue.put_nowait(error)

    def _decode_outputs(self, raws: list[msgspec.Raw]) -> dict[str, list[EngineCoreOutput]]:
        """The step's outputs by request id; a malformed one fails its request, never the others."""
        by_request: dict[str, list[EngineCoreOutput]] = {}
        for raw in raws:
            try:
                out = self._decode_output(raw)
            except msgspec.ValidationError as e:
                try:
                    rid = self._decode_id(raw).request_id.partition("#")[0]
                except msgspec.ValidationError:
                    log.error("the engine sent an output without a request id (%s); dropped", e)
                    continue
                log.error("the engine sent a malformed output for request %s (%s); failing that request", rid, e)
                self._fail(rid, errors.internal(f"internal error: malformed engine output for this request: {e}"))
                continue
            by_request.setdefault(out.request_id.partition("#")[0], []).append(out)
        return by_request

    def _handle(self, msg: OutputsIn) -> None:
        self.metrics.engine_step(msg.stats)
        st = msg.stats
        if st.num_batched_tokens and st.step_duration > 0:
            rate = st.num_batched_tokens / st.step_duration
            self._prefill_rate = rate if self._prefill_rate is None else 0.8 * self._prefill_rate + 0.2 * rate
        for cid, when in msg.received.items():
            t = self._requests.get(cid.partition("#")[0])
            if t is not None and t.engine_arrival_time is None:
                t.engine_arrival_time = when
        for cid, why in msg.rejected.items():
            self._fail(cid.partition("#")[0], errors.bad_request(why))
        to_abort: list[str] = []
        for rid, outs in self._decode_outputs(msg.outputs).items():
            try:
                self._deliver(outs, msg.timestamp, to_abort)
            except Exception as e:  # a bug in one request's processing fails that request only
                log.exception("processing the outputs of request %s failed", rid)
                self._fail(rid, errors.internal(f"internal error: {e!r}"))
        if to_abort:  # stop strings, found here after detokenization
            self._in.send(self._encode(Abort(to_abort)))

    def _deliver(self, outs: list[EngineCoreOutput], timestamp: float, to_abort: list[str]) -> None:
        results, stopped = self.outputs.process(outs)
        to_abort += stopped
        for out in results:
            t = self._requests.get(out.request_id)
            if t is None:
                continue
            num_tokens = sum(len(c.token_ids) for c in out.outputs)
            if num_tokens > t.num_tokens:
                gap = None if t.last_token_time is None else timestamp - t.last_token_time
                self.metrics.new_tokens(t.lane, num_tokens - t.num_tokens, gap)
                t.num_tokens, t.last_token_time = num_tokens, timestamp
            if not t.started and out.metrics.first_token_time is not None:
                self._started(t)
                self.metrics.first_token(t.lane, out)
            if out.finished:
                del self._requests[out.request_id]
                self._started(t)
                self.metrics.finished(t.lane, out)
            t.queue.put_nowait(out)
