"""Server-side request merging (``--enable-request-merging``): identical concurrent requests
share one generation.

Two requests are identical when their prompt token ids, sampling parameters, lane and
priority are equal; they may share only when the answer is determined by those
(greedy, ``temperature`` 0, or a fixed ``seed``): then one engine request serves them
all. A request that arrives while an identical one is still generating subscribes to
it: it first gets the outputs so far (they are cumulative, so a late subscriber's
stream starts with everything generated until then), then every new one; streams fan
out from there. Each subscriber keeps its own timeout and disconnect: the shared
generation is aborted only when its last subscriber goes.

Usage in each response is that of the answer the client got; ``/metrics`` counts the
engine's work once (``generation_tokens_total``, ``request_success_total``) and
``request_merge_queries_total`` / ``request_merge_hits_total`` the eligible requests
and those that joined a generation.
"""

from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator

from prometheus_client import CollectorRegistry, Counter

from expresslane.outputs import RequestOutput
from expresslane.sampling_params import SamplingParams
from expresslane.server import errors
from expresslane.server.tracker import next_output, queued_outputs


def mergeable(params: SamplingParams) -> bool:
    """Is the answer a function of the request alone? Greedy, or sampled with a fixed seed."""
    return params.temperature == 0 or params.seed is not None


class _Subscriber:
    """One HTTP request's view of a shared generation (what the endpoints read from a RequestGroup)."""

    def __init__(self, shared: "_Shared", timeout: float | None):
        self.shared = shared
        self.tracked = shared.group.tracked
        self.queue: asyncio.Queue = asyncio.Queue()
        self.timeout = timeout
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.head: list[RequestOutput] = []

    def outputs(self) -> AsyncIterator[RequestOutput]:
        head, self.head = self.head, []
        return queued_outputs(self.queue, self.tracked, self.deadline, self.timeout, self.close, head)

    async def started(self) -> None:
        self.head.append(await next_output(self.queue, self.deadline, self.timeout, self.close))

    def close(self) -> None:
        self.shared.leave(self)

    def engine_arrival_time(self, request_id: str) -> float | None:
        return self.shared.group.engine_arrival_time(request_id)


class _Shared:
    """One engine request group and the HTTP requests reading it."""

    def __init__(self, merger: "RequestMerger", key: str, group):
        self.merger, self.key, self.group = merger, key, group
        self.latest: dict[str, RequestOutput] = {}
        self.subscribers: set[_Subscriber] = set()
        self.task = asyncio.get_running_loop().create_task(self._pump())

    def join(self, timeout: float | None) -> _Subscriber:
        sub = _Subscriber(self, timeout)
        for out in self.latest.values():  # everything so far (cumulative outputs)
            sub.queue.put_nowait(out)
        self.subscribers.add(sub)
        return sub

    def leave(self, sub: _Subscriber) -> None:
        self.subscribers.discard(sub)
        if not self.subscribers and not self.task.done():
            self.merger.forget(self)
            self.task.cancel()
            self.group.close()  # nobody wants it any more: free its KV blocks

    async def _pump(self) -> None:
        try:
            async for out in self.group.outputs():
                self.latest[out.request_id] = out
                for sub in self.subscribers:
                    sub.queue.put_nowait(out)
        except errors.APIError as e:
            for sub in self.subscribers:
                sub.queue.put_nowait(e)
        except Exception as e:  # noqa: BLE001 - a bug here must not leave subscribers waiting
            for sub in self.subscribers:
                sub.queue.put_nowait(errors.internal(f"internal error: {e!r}"))
        finally:
            self.merger.forget(self)  # finished: a new identical request starts its own generation


class RequestMerger:
    def __init__(self, client, registry: CollectorRegistry, model_name: str):
        self.client = client
        self._live: dict[str, _Shared] = {}
        self.queries = Counter("expresslane:request_merge_queries", "Requests eligible for merging (greedy or "
                               "seeded) with merging on.", ("model_name",), registry=registry).labels(model_name)
        self.hits = Counter("expresslane:request_merge_hits", "Requests served by an identical request's "
                            "generation.", ("model_name",), registry=registry).labels(model_name)

    def submit(self, request_id: str, prompts: list[tuple[str | None, list[int]]], params: SamplingParams, *,
               priority: int, lane: str | None, timeout: float | None):
        """As ``EngineClient.submit``; an identical request already generating is joined instead."""
        if not mergeable(params):
            return self.client.submit(request_id, prompts, params, priority=priority, lane=lane, timeout=timeout)
        self.queries.inc()
        key = repr((tuple(tuple(ids) for _, ids in prompts), params, priority, lane))
        shared = self._live.get(key)
        if shared is not None:
            self.hits.inc()
        else:  # the engine request has no deadline of its own: each subscriber keeps its own
            group = self.client.submit(request_id, prompts, params, priority=priority, lane=lane, timeout=None)
            shared = self._live[key] = _Shared(self, key, group)
        return shared.join(timeout)

    def forget(self, shared: _Shared) -> None:
        if self._live.get(shared.key) is shared:
            del self._live[shared.key]
