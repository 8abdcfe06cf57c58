"""EngineClient: the API process's side of the engine, and the server's life cycle::

    starting -> ready -> draining -> stopped
                ready -> restarting -> ready      (the engine died; in-flight requests failed)
                         restarting -> dead       (--engine-restarts used up: the server exits 1)

It composes three parts: ``EngineLink`` (the engine process and its sockets),
``AdmissionPolicy`` (what may come in) and ``RequestTracker`` (requests in flight,
detokenization and stop strings, one queue per HTTP request). ``run`` starts the engine
and keeps one running: when it dies, every request in flight fails at once (500
``engine_dead``) and a new engine starts after a backoff, at most ``engine_restarts``
times in the server's life.
"""

from __future__ import annotations

import asyncio
import collections
import gc
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

from expresslane.config.flags import default_of
from expresslane.config.server import ServerConfig
from expresslane.engine.generation_config import sampling_defaults
from expresslane.engine.inputs import InputProcessor
from expresslane.lanes import resolve_lane
from expresslane.models.model_dir import check_model_dir, default_model_path, read_config, text_config
from expresslane.pooling_params import PoolingParams
from expresslane.sampling_params import SamplingParams
from expresslane.server import errors
from expresslane.server.admission import AdmissionLimits, AdmissionPolicy, Work
from expresslane.server.engine_link import EngineLink, EngineStartError
from expresslane.server.limits import longest_token_chars
from expresslane.server.metrics import Metrics
from expresslane.server.tracker import RequestGroup, RequestTracker
from expresslane.contract import LoRARequest
from expresslane.server.wire import Abort, LoadLoRA, LoRADone, OutputsIn, Profile, Profiled, UnloadLoRA, add_messages
from expresslane.tokenizer import eos_token_ids, load_tokenizer

log = logging.getLogger(__name__)

RESTART_BACKOFF_S = 0.5  # before the first restart; doubles with each one, up to the cap
MAX_RESTART_BACKOFF_S = 30.0


class EngineClient:
    def __init__(self, engine_kwargs: dict[str, Any], metrics: Metrics, limits: AdmissionLimits,
                 log_level: str, engine_restarts: int = default_of(ServerConfig, "engine_restarts"),
                 profile_dir: str | None = None):
        self.state = "starting"
        self.model_dir: Path | None = None
        self.sampling_defaults: dict = {}  # the generation config's (--generation-config)
        self.max_model_len: int | None = None
        self.runner_type = "generate"  # the engine's (Ready): generate or pooling
        self.metrics = metrics
        self.admission = AdmissionPolicy(limits)
        self.engine_restarts = engine_restarts
        self.engine_failed = False  # the engine died while draining or for good: exit non-zero
        self.tracker: RequestTracker | None = None
        self._engine_kwargs = engine_kwargs
        self._log_level = log_level
        self._link: EngineLink | None = None
        self._runner: asyncio.Task | None = None  # run(), when start() began it
        self.profile_dir = profile_dir
        self._profile_replies: collections.deque[asyncio.Future] = collections.deque()  # the engine answers in order
        self._lora_replies: collections.deque[asyncio.Future] = collections.deque()  # (in order too)

    @property
    def engine_kwargs(self) -> dict[str, Any]:
        """The engine's flags (the model directory resolved once it runs)."""
        return self._engine_kwargs

    @property
    def num_inflight(self) -> int:
        return 0 if self.tracker is None else len(self.tracker)

    @property
    def num_admitted(self) -> int:
        """Requests admitted since start (a restart's tracker keeps counting)."""
        return 0 if self.tracker is None else self.tracker.num_added

    @property
    def engine_pid(self) -> int | None:
        return None if self._link is None else self._link.pid

    # -- life cycle ---------------------------------------------------------------------------
    async def run(self, on_ready: Callable[[], None] = lambda: None) -> None:
        """Start the engine, then keep one running until ``close`` or until the restarts are
        used up (``state == "dead"``). Raises EngineStartError when the first start fails."""
        model = self._engine_kwargs.get("model")
        if model is None:  # the built-in model: the engine process builds it on first use (this one has no torch)
            self.model_dir = default_model_path()
        else:
            self.model_dir = await asyncio.to_thread(check_model_dir, model)
            self._engine_kwargs = {**self._engine_kwargs, "model": str(self.model_dir)}
        frontend = None
        if self.model_dir.is_dir() and "vocab_size" in text_config(read_config(self.model_dir)):
            frontend = asyncio.ensure_future(asyncio.to_thread(self._load_frontend))  # while the engine loads
        ready = await self._start_engine()
        tokenizer, vocab_size, eos, longest_token, token_texts = await (frontend or asyncio.to_thread(
            self._load_frontend, ready.vocab_size))
        self.tokenizer = tokenizer
        self.max_model_len = ready.max_model_len
        self.num_kv_blocks = ready.num_kv_blocks
        self.step_cost, self.max_num_batched_tokens = ready.step_cost, ready.max_num_batched_tokens
        self.scheduling_policy, self.pd_lanes = ready.scheduling_policy, ready.pd_lanes
        self.runner_type, self.hidden_size = ready.runner_type, ready.hidden_size
        self.inputs = InputProcessor(tokenizer, vocab_size, ready.max_model_len, eos)
        self.sampling_defaults = await asyncio.to_thread(
            sampling_defaults, self._engine_kwargs.get("generation_config", "auto"), self.model_dir)
        self.max_prompt_chars = ready.max_model_len * longest_token
        # Each token id's text (logprobs name tokens by it), decoded once at start: made lazily during a
        # large response, these long-lived strings pinned the allocator's arenas of its garbage (+20 MB RSS).
        self.token_texts = token_texts
        self.tracker = RequestTracker(tokenizer, self.admission, self.metrics, token_texts)
        # The start-up heap (tokenizer, token texts, the app) out of the collector's reach: a full
        # collection in the middle of a large logprobs request scanned it all, holding the event
        # loop (and /health) for tens of milliseconds.
        gc.collect()
        gc.freeze()
        self.state = "ready"
        log.info("engine ready: %s, max_model_len %d, %d KV blocks", self.model_dir, self.max_model_len,
                 self.num_kv_blocks)
        on_ready()
        restarts = 0
        while True:
            why = await self._serve_engine()
            self._fail_in_flight(errors.engine_dead())
            if self.state != "ready":  # draining or stopped: no new engine
                log.error("%s while shutting down", why)
                self.engine_failed = True
                return
            log.error("%s; failed every request in flight", why)
            while True:
                if restarts >= self.engine_restarts:
                    self.state, self.engine_failed = "dead", True
                    log.error("the engine died and no restarts are left (--engine-restarts %d): exiting",
                              self.engine_restarts)
                    return
                restarts += 1
                self.state = "restarting"
                delay = min(RESTART_BACKOFF_S * 2 ** (restarts - 1), MAX_RESTART_BACKOFF_S)
                log.warning("starting a new engine in %.1f s (restart %d of %d)", delay, restarts,
                            self.engine_restarts)
                await asyncio.sleep(delay)
                try:
                    await self._start_engine()
                    break
                except EngineStartError as e:
                    log.error("engine restart failed: %s", e)
            self.state = "ready"
            log.warning("the engine is serving again (restart %d of %d)", restarts, self.engine_restarts)

    async def start(self) -> None:
        """``run`` in the background; returns once the engine serves (raises when it cannot start)."""
        ready = asyncio.get_running_loop().create_future()
        self._runner = asyncio.create_task(self.run(lambda: ready.set_result(None)))
        await asyncio.wait({ready, self._runner}, return_when=asyncio.FIRST_COMPLETED)
        if not ready.done():
            self._runner.result()

    def _load_frontend(self, vocab_size: int | None = None):
        """`vocab_size`: the engine's, where config.json does not state it."""
        config = text_config(read_config(self.model_dir))  # not AutoConfig: this process imports no torch
        vocab_size = config.get("vocab_size", vocab_size)
        tokenizer = load_tokenizer(self._engine_kwargs.get("tokenizer") or self.model_dir)
        eos = eos_token_ids(self.model_dir, SimpleNamespace(eos_token_id=config.get("eos_token_id")), tokenizer)
        token_texts = tuple(tokenizer.batch_decode([[t] for t in range(vocab_size)]))
        return tokenizer, vocab_size, eos, longest_token_chars(tokenizer), token_texts

    async def _start_engine(self):
        if self._link is not None:
            await self._link.stop()
        self._link = EngineLink(self._engine_kwargs, self._log_level, self.profile_dir)
        try:
            return await self._link.start()
        except BaseException:
            await self._link.stop()
            raise

    async def _serve_engine(self) -> str:
        """Read the engine's outputs until it dies; returns why (the process is reaped by then)."""
        link = self._link
        reader = asyncio.ensure_future(self._read(link))
        try:
            await asyncio.wait({reader, link.exited}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            reader.cancel()
        why = reader.result() if reader.done() and not reader.cancelled() else None
        await link.stop()  # kills it when it is still running (a corrupt stream)
        return why or f"the engine process exited unexpectedly (exit code {link.exited.result()})"

    async def _read(self, link: EngineLink) -> str:
        while True:
            # zmq.asyncio resolves recv at once when a message is queued, and awaiting a done
            # future does not yield: without this, a burst of engine turns (a fast GPU stepping
            # n=128 with logprobs) held the event loop for 160-270 ms, /health and streams with it.
            await asyncio.sleep(0)
            try:
                msg = await link.recv()
            except Exception as e:  # the stream is corrupt: nothing after it can be trusted
                return f"the engine sent an undecodable message ({e!r})"
            if isinstance(msg, OutputsIn):
                to_abort = self.tracker.handle(msg)
                if to_abort:
                    link.send(Abort(to_abort))
            elif isinstance(msg, (Profiled, LoRADone)):
                replies = self._profile_replies if isinstance(msg, Profiled) else self._lora_replies
                reply = replies.popleft() if replies else None
                if reply is not None and not reply.done():  # cancelled when its HTTP client went away
                    reply.set_result(msg)

    def _fail_in_flight(self, error: errors.APIError) -> None:
        if self.tracker is not None:
            self.tracker.fail_all(error)
        for replies in (self._profile_replies, self._lora_replies):
            while replies:
                reply = replies.popleft()
                if not reply.done():
                    reply.set_exception(error)
        self.metrics.engine_stopped()

    async def profile(self, start: bool) -> Profiled:
        """Start or stop the engine's torch profiler (``--profile-dir``); raises APIError when refused."""
        if self.profile_dir is None:
            raise errors.APIError(404, "profiling is off: start the server with --profile-dir DIR",
                                  "not_found_error", None, "profiling_disabled")
        self.check_accepting()
        reply = asyncio.get_running_loop().create_future()
        self._profile_replies.append(reply)
        self._link.send(Profile(start))
        msg = await reply
        if msg.error is not None:
            raise errors.APIError(msg.status, msg.error, "invalid_request_error" if msg.status == 400
                                  else "internal_error", None, "profile_state" if msg.status == 400
                                  else "profile_failed")
        return msg

    async def change_lora(self, msg: LoadLoRA | UnloadLoRA) -> None:
        """Load or unload an adapter in the engine; raises APIError when the engine refuses."""
        self.check_accepting()
        reply = asyncio.get_running_loop().create_future()
        self._lora_replies.append(reply)
        self._link.send(msg)
        done: LoRADone = await reply
        if done.error is not None:
            raise errors.APIError(done.status, done.error, "not_found_error" if done.status == 404
                                  else "invalid_request_error", "lora_name" if done.status == 404 else "lora_path",
                                  "lora_not_found" if done.status == 404 else "invalid_lora_adapter")

    def start_draining(self) -> None:
        if self.state == "ready":
            self.state = "draining"

    def end_in_flight(self, reason: str) -> int:
        """Fail every request still in flight (streams get an SSE error and [DONE]); returns how many."""
        n = self.num_inflight
        self._fail_in_flight(errors.unavailable(reason, "shutting_down", retry_after=None))
        return n

    async def close(self) -> None:
        """Stop the engine process (politely, then by force) and reap it."""
        if self.state != "dead":
            self.state = "stopped"
        if self._runner is not None:
            self._runner.cancel()
        if self._link is not None:
            await self._link.stop()

    # -- requests -----------------------------------------------------------------------------
    def check_accepting(self) -> None:
        if self.state == "ready":
            return
        if self.state == "starting":
            raise errors.unavailable("the server is starting", "starting")
        if self.state == "restarting":
            raise errors.unavailable("the engine is restarting after a failure; retry shortly", "restarting")
        if self.state == "draining":
            raise errors.unavailable("the server is shutting down", "shutting_down")
        raise errors.unavailable("the engine is not running", "engine_dead", retry_after=None)

    def submit(self, request_id: str, prompts: list[tuple[str | None, list[int]]],
               params: SamplingParams | PoolingParams, *, priority: int, lane: str | None,
               timeout: float | None, lora_request: LoRARequest | None = None) -> RequestGroup:
        """Admit and send one HTTP request's prompts (already validated); raises APIError 503 when full.
        PoolingParams: embeddings (a pooling engine), one vector a prompt."""
        self.check_accepting()
        lane = resolve_lane(lane, priority)
        pooling = isinstance(params, PoolingParams)
        self.admission.check(Work(lane, tuple(len(ids) for _, ids in prompts), 1 if pooling else params.n))
        if pooling:
            group, batch = self.tracker.add_pooling(request_id, prompts, params, lane=lane, priority=priority,
                                                    timeout=timeout)
        else:
            group, batch = self.tracker.add(request_id, prompts, params, lane=lane, priority=priority,
                                            eos=self.inputs.eos, timeout=timeout, lora_request=lora_request)
        group.abort = self.abort
        try:
            self._link.send(*add_messages(batch))
        except Exception:  # not sent (say, a value the wire format cannot carry): leave no trace
            for key in group.tracked:
                self.tracker.abort(key)
            raise
        return group

    def abort(self, key: str) -> None:
        seq_ids = self.tracker.abort(key)
        if seq_ids and self.state in ("ready", "draining"):
            self._link.send(Abort(seq_ids))
