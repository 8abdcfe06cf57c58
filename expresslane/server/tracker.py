"""Requests in flight on the API side: from engine messages to each HTTP request's queue.

One id scheme. An HTTP request ``X`` has prompts ``X-0, X-1, ...`` (the keys of
``RequestGroup.tracked``); prompt ``K`` with ``n > 1`` runs in the engine as sequences
``K#0 .. K#{n-1}`` (``OutputProcessor``'s children), ``K`` itself when ``n == 1``. Every
engine id is registered here at submission and looked up, never parsed.

The tracker does no I/O: it returns the engine ids to abort and the caller sends them.
Admission is told when each sequence stops waiting (first token, end or abort).
"""

from __future__ import annotations

import asyncio
import dataclasses
from array import array
import logging
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

import msgspec

from expresslane.engine.output_processor import OutputProcessor, child_params
from expresslane.contract import POOLING_SAMPLING, EngineCoreOutput, EngineCoreRequest, LoRARequest
from expresslane.outputs import EmbeddingOutput, EmbeddingRequestOutput, RequestMetrics, RequestOutput
from expresslane.pooling_params import PoolingParams
from expresslane.sampling_params import SamplingParams
from expresslane.server import errors
from expresslane.server.admission import AdmissionPolicy
from expresslane.server.metrics import Metrics
from expresslane.server.wire import OutputId, OutputsIn

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Prompt:
    """One prompt of a request (an ``OutputProcessor`` parent) and its engine sequences."""

    key: str
    queue: asyncio.Queue  # its request's (not the RequestGroup: no reference cycle, see OutputProcessor's _Child)
    keys: list[str]  # its request's prompts
    lane: str
    num_prompt_tokens: int
    seq_ids: list[str]
    waiting: set[str]  # sequences without a first token yet (admission counts them)
    num_tokens: int = 0
    last_token_time: float | None = None
    engine_arrival_time: float | None = None  # when the engine process took it: its own TTFT starts there
    started: bool = False
    embedding: EmbeddingRequestOutput | None = None  # a pooling prompt's output, filled when it finishes


class TopLogprobs:
    """One token's logprobs (token id -> logprob, as the engine's dict) held in two arrays: a
    request keeps every token's until it ends (n=128 × 64 tokens × 21 entries: 172,000), and as
    dicts of Python ints and floats those filled the allocator's small-object arenas, which a
    few long-lived objects then kept from being returned. The reads serving needs: get, items."""

    __slots__ = ("ids", "values")

    def __init__(self, lp: dict[int, float]):
        self.ids = array("i", lp.keys())  # token ids fit int32 (the wire's bound, protocol.INT32)
        self.values = array("d", lp.values())  # the floats as sent, exactly

    def get(self, token_id: int, default: float | None = None) -> float | None:
        for i, t in enumerate(self.ids):
            if t == token_id:
                return self.values[i]
        return default

    def items(self):
        return zip(self.ids, self.values)


async def next_output(queue: asyncio.Queue, deadline: float | None, timeout: float | None,
                close: Callable[[], None]) -> RequestOutput:
    """The next output from `queue`: past `deadline` a 504, an APIError put in the queue raised;
    `close` runs before either is raised."""
    try:
        if not queue.empty() or deadline is None:  # the common case: no timer task
            item = await queue.get()
        else:
            item = await asyncio.wait_for(queue.get(), deadline - time.monotonic())
    except TimeoutError:
        close()
        raise errors.request_timeout(timeout) from None
    if isinstance(item, errors.APIError):
        close()
        raise item
    return item


async def queued_outputs(queue: asyncio.Queue, keys, deadline: float | None, timeout: float | None,
                         close: Callable[[], None], head: list[RequestOutput] | None = None
                         ) -> AsyncIterator[RequestOutput]:
    """Outputs (`head` first, then from `queue`) until every prompt in `keys` has finished (a
    request's own queue, or a merged subscriber's)."""
    pending = set(keys)
    head = list(head or ())
    while pending:
        item = head.pop(0) if head else await next_output(queue, deadline, timeout, close)
        if item.finished:
            pending.discard(item.request_id)
        yield item


@dataclass(slots=True)
class RequestGroup:
    """The outputs of one HTTP request: one or more prompts sharing a queue."""

    tracked: dict[str, _Prompt]  # prompt key -> its state, kept after it finishes
    queue: asyncio.Queue
    deadline: float | None
    timeout: float | None
    abort: Callable[[str], None] = lambda key: None
    head: list[RequestOutput] = field(default_factory=list)  # taken by `started`, given first by `outputs`

    def outputs(self) -> AsyncIterator[RequestOutput]:
        """Cumulative outputs until every prompt is finished; raises APIError on failure."""
        head, self.head = self.head, []
        return queued_outputs(self.queue, self.tracked, self.deadline, self.timeout, self.close, head)

    async def started(self) -> None:
        """Wait for the first output, or raise the request's error (a stream's status can then
        still say 400: a grammar the engine could not compile)."""
        self.head.append(await next_output(self.queue, self.deadline, self.timeout, self.close))

    def close(self) -> None:
        """Abort whatever has not finished (client gone, timeout, error); idempotent."""
        for key in self.tracked:
            self.abort(key)

    def engine_arrival_time(self, key: str) -> float | None:
        return self.tracked[key].engine_arrival_time


class RequestTracker:
    def __init__(self, tokenizer, admission: AdmissionPolicy, metrics: Metrics, token_texts=None):
        self.tokenizer = tokenizer
        self.token_texts = token_texts  # each token id's text (prompt logprobs name tokens by it)
        self.admission = admission
        self.metrics = metrics
        self.outputs = OutputProcessor(tokenizer, token_texts)
        self._prompts: dict[str, _Prompt] = {}  # unfinished prompts by key
        self._seqs: dict[str, _Prompt] = {}  # engine id -> its prompt
        self.num_added = 0  # requests registered since start
        self._decode_output = msgspec.msgpack.Decoder(EngineCoreOutput).decode
        self._decode_id = msgspec.msgpack.Decoder(OutputId).decode

    def __len__(self) -> int:
        return len(self._prompts)

    def add(self, request_id: str, prompts: list[tuple[str | None, list[int]]], params: SamplingParams, *,
            lane: str, priority: int, eos: tuple[int, ...], timeout: float | None,
            lora_request: LoRARequest | None = None) -> tuple[RequestGroup, list[EngineCoreRequest]]:
        """Register an admitted request; returns its group and the engine requests to send."""
        arrival = time.monotonic()
        self.num_added += 1
        group = RequestGroup({}, asyncio.Queue(), None if timeout is None else arrival + timeout, timeout)
        batch = []
        keys = [f"{request_id}-{i}" for i in range(len(prompts))]
        engine_params = dataclasses.replace(params, stop=[])  # stop strings are matched here, not in the engine
        work = sum(len(ids) for _, ids in prompts)  # the n children of a prompt share its prefill
        for key, (text, ids) in zip(keys, prompts):
            seq_ids = self.outputs.add_request(key, text, ids, params, arrival)
            p = _Prompt(key, group.queue, keys, lane, len(ids), seq_ids, set(seq_ids))
            group.tracked[key] = self._prompts[key] = p
            for j, sid in enumerate(seq_ids):
                self._seqs[sid] = p
                sp = engine_params if params.n == 1 else child_params(engine_params, j)
                batch.append(EngineCoreRequest(sid, ids, sp, eos, arrival, priority, lane, work, lora_request=lora_request))
            self.admission.add(lane, len(seq_ids), len(seq_ids) * len(ids))
        return group, batch

    def add_pooling(self, request_id: str, prompts: list[tuple[str | None, list[int]]], params: PoolingParams, *,
                    lane: str, priority: int, timeout: float | None
                    ) -> tuple[RequestGroup, list[EngineCoreRequest]]:
        """As ``add``, for embeddings: one engine sequence a prompt (its key), no detokenizer."""
        arrival = time.monotonic()
        self.num_added += 1
        group = RequestGroup({}, asyncio.Queue(), None if timeout is None else arrival + timeout, timeout)
        keys = [f"{request_id}-{i}" for i in range(len(prompts))]
        work = sum(len(ids) for _, ids in prompts)
        batch = []
        for key, (text, ids) in zip(keys, prompts):
            out = EmbeddingRequestOutput(key, EmbeddingOutput([]), ids, False, RequestMetrics(arrival), text)
            p = _Prompt(key, group.queue, keys, lane, len(ids), [key], {key}, embedding=out)
            group.tracked[key] = self._prompts[key] = self._seqs[key] = p
            batch.append(EngineCoreRequest(key, ids, POOLING_SAMPLING, (), arrival, priority, lane, work,
                                           pooling_params=params))
            self.admission.add(lane, 1, len(ids))
        return group, batch

    def abort(self, key: str) -> list[str]:
        """Finish a prompt as aborted here; returns the engine ids the caller must abort."""
        p = self._prompts.pop(key, None)
        if p is None:
            return []
        self._forget(p)
        out = self.outputs.abort(key)
        if out is not None:
            self.metrics.finished(p.lane, out)
        return p.seq_ids

    def fail(self, key: str, error: errors.APIError) -> list[str]:
        """End one prompt's request with an error; returns the engine ids to abort."""
        p = self._prompts.get(key)
        if p is None:
            return []
        to_abort = [sid for k in p.keys for sid in self.abort(k)]
        p.queue.put_nowait(error)
        return to_abort

    def fail_all(self, error: errors.APIError) -> None:
        """The engine is gone: every request in flight ends with ``error``."""
        queues = {id(p.queue): p.queue for p in self._prompts.values()}
        for q in queues.values():
            q.put_nowait(error)
        self._prompts.clear()
        self._seqs.clear()
        self.outputs = OutputProcessor(self.tokenizer, self.token_texts)
        self.admission.reset()

    def _forget(self, p: _Prompt) -> None:
        self._started(p, list(p.waiting))
        for sid in p.seq_ids:
            self._seqs.pop(sid, None)

    def _started(self, p: _Prompt, seq_ids: list[str]) -> None:
        n = 0
        for sid in seq_ids:
            if sid in p.waiting:
                p.waiting.discard(sid)
                n += 1
        if n:
            self.admission.started(p.lane, n, n * p.num_prompt_tokens)

    # -- engine messages ----------------------------------------------------------------------
    def handle(self, msg: OutputsIn) -> list[str]:
        """Apply one engine turn; returns the engine ids to abort (stop strings, failed requests)."""
        self.metrics.engine_step(msg.stats)
        self.admission.observe_step(msg.stats.num_batched_tokens, msg.stats.step_duration)
        for sid, when in msg.received.items():
            p = self._seqs.get(sid)
            if p is not None and p.engine_arrival_time is None:
                p.engine_arrival_time = when
        to_abort: list[str] = []
        for sid, why in msg.rejected.items():
            field = why.split(":", 1)[0]  # the engine's refusals start with the field at fault, when one is
            to_abort += self._fail_seq(sid, errors.bad_request(why, field if field.isidentifier() else None))
        by_prompt: dict[str, list[EngineCoreOutput]] = {}
        for raw in msg.outputs:
            try:
                out = self._decode_output(raw)
            except msgspec.ValidationError as e:  # fail its request only
                to_abort += self._malformed(raw, e)
                continue
            p = self._seqs.get(out.request_id)
            if p is not None:
                by_prompt.setdefault(p.key, []).append(out)
        for key, outs in by_prompt.items():
            try:
                to_abort += self._deliver(self._prompts[key], outs, msg.timestamp)
            except Exception as e:  # a bug in one request's processing fails that request only
                log.exception("processing the outputs of %s failed", key)
                to_abort += self.fail(key, errors.internal(f"internal error: {e!r}"))
        return to_abort

    def _fail_seq(self, sid: str, error: errors.APIError) -> list[str]:
        p = self._seqs.get(sid)
        return [] if p is None else self.fail(p.key, error)

    def _malformed(self, raw: msgspec.Raw, e: msgspec.ValidationError) -> list[str]:
        try:
            sid = self._decode_id(raw).request_id
        except msgspec.ValidationError:
            log.error("the engine sent an output without a request id (%s); dropped", e)
            return []
        log.error("the engine sent a malformed output for sequence %s (%s); failing its request", sid, e)
        return self._fail_seq(sid, errors.internal(f"internal error: malformed engine output for this request: {e}"))

    def _deliver(self, p: _Prompt, outs: list[EngineCoreOutput], timestamp: float) -> list[str]:
        if p.embedding is not None:
            self._deliver_embedding(p, outs)
            return []
        for o in outs:
            if o.new_logprobs:
                o.new_logprobs = [TopLogprobs(lp) for lp in o.new_logprobs]
        results, stopped = self.outputs.process(outs)
        self._started(p, [o.request_id for o in outs if o.new_token_ids or o.finish_reason is not None])
        for out in results:
            num_tokens = sum(len(c.token_ids) for c in out.outputs)
            if num_tokens > p.num_tokens:
                gap = None if p.last_token_time is None else timestamp - p.last_token_time
                self.metrics.new_tokens(p.lane, num_tokens - p.num_tokens, gap)
                p.num_tokens, p.last_token_time = num_tokens, timestamp
            if not p.started and out.metrics.first_token_time is not None:
                p.started = True
                self.metrics.first_token(p.lane, out)
            if out.finished:
                del self._prompts[out.request_id]
                self._forget(p)
                self.metrics.finished(p.lane, out)
            p.queue.put_nowait(out)
        return stopped

    def _deliver_embedding(self, p: _Prompt, outs: list[EngineCoreOutput]) -> None:
        for o in outs:
            if o.finish_reason is None or p.key not in self._prompts:
                continue
            out = p.embedding
            if o.pooled is None:  # aborted in the engine: the client that aborted it reads nothing
                self.abort(p.key)
                continue
            out.outputs.embedding, out.finished, out.num_cached_tokens = o.pooled, True, o.num_cached_tokens
            out.metrics.first_scheduled_time = o.first_scheduled_time
            out.metrics.first_token_time, out.metrics.finished_time = o.first_token_time, o.finished_time
            del self._prompts[p.key]
            self._forget(p)
            self.metrics.embedded(p.lane, out)
            p.queue.put_nowait(out)
