"""An async client for expresslane (and any OpenAI-compatible server) that backs off politely.

- A 408/429/502/503/504 answer, or a connection that fails before any answer, is
  retried after the server's ``Retry-After`` (else jittered exponential backoff), at
  most ``backoff.max_retries`` times.
- A stream is retried only until its first event reaches the caller: once tokens have
  been delivered, a broken stream raises ``StreamInterrupted`` and is never sent again
  (the caller already showed those tokens; a second run would repeat or contradict them).
- Each request runs in a lane (``interactive`` or ``batch``, sent as the ``lane`` field)
  with that lane's timeout.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
from typing import AsyncIterator, Awaitable, Callable

import httpx

from expresslane.backoff import RETRY_STATUS, Backoff

DEFAULT_TIMEOUTS = {"interactive": 60.0, "batch": 1800.0}  # seconds per attempt


class APIStatusError(Exception):
    """The server answered with an error status (after any retries)."""

    def __init__(self, status: int, body: str):
        self.status, self.body = status, body
        try:
            err = json.loads(body).get("error") or {}
            message = err.get("message") if isinstance(err, dict) else str(err)
        except (ValueError, AttributeError):
            message = body[:200]
        super().__init__(f"HTTP {status}: {message}")


class StreamInterrupted(Exception):
    """A stream broke after it delivered events; it is not retried."""


class Client:
    def __init__(self, base_url: str, api_key: str | None = None, *, backoff: Backoff = Backoff(),
                 timeouts: dict[str, float] | None = None, rng: random.Random | None = None,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep):
        root = base_url.rstrip("/")
        root = root[:-3] if root.endswith("/v1") else root
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.AsyncClient(base_url=root, headers=headers)
        self.backoff = backoff
        self.timeouts = {**DEFAULT_TIMEOUTS, **(timeouts or {})}
        self.rng = rng or random.Random()
        self.sleep = sleep  # tests pass a recorder: no wall clock
        self.requests_sent = 0  # HTTP requests, retries included

    async def aclose(self) -> None:
        await self.http.aclose()

    async def __aenter__(self) -> "Client":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    def _timeout(self, lane: str) -> httpx.Timeout:
        if lane not in self.timeouts:
            raise ValueError(f"unknown lane {lane!r}; timeouts are set for {', '.join(self.timeouts)}")
        return httpx.Timeout(self.timeouts[lane], connect=min(10.0, self.timeouts[lane]))

    async def _wait(self, attempt: int, retry_after: str | None) -> None:
        await self.sleep(self.backoff.delay(attempt, retry_after, self.rng))

    async def post(self, path: str, body: dict, *, lane: str = "interactive") -> dict:
        """POST a JSON body; the JSON answer, after retries. Raises APIStatusError."""
        timeout = self._timeout(lane)
        for attempt in itertools.count():
            last = attempt >= self.backoff.max_retries
            try:
                self.requests_sent += 1
                r = await self.http.post(path, json={**body, "lane": lane}, timeout=timeout)
            except httpx.TransportError:
                if last:
                    raise
                await self._wait(attempt, None)
                continue
            if r.status_code == 200:
                return r.json()
            if r.status_code not in RETRY_STATUS or last:
                raise APIStatusError(r.status_code, r.text)
            await self._wait(attempt, r.headers.get("retry-after"))
        raise AssertionError("unreachable")

    async def stream(self, path: str, body: dict, *, lane: str = "interactive") -> AsyncIterator[dict]:
        """The SSE events of a streamed request (``[DONE]`` ends it); retried only before the first event."""
        timeout = self._timeout(lane)
        body = {**body, "stream": True, "lane": lane}
        for attempt in itertools.count():
            last = attempt >= self.backoff.max_retries
            delivered = 0
            retry_after: str | None = None
            try:
                self.requests_sent += 1
                async with self.http.stream("POST", path, json=body, timeout=timeout) as r:
                    if r.status_code != 200:
                        text = (await r.aread()).decode(errors="replace")
                        if r.status_code not in RETRY_STATUS or last:
                            raise APIStatusError(r.status_code, text)
                        retry_after = r.headers.get("retry-after", "")
                    else:
                        async for line in r.aiter_lines():
                            if not line.startswith("data:"):
                                continue
                            payload = line[5:].strip()
                            if payload == "[DONE]":
                                return
                            event = json.loads(payload)
                            if "error" in event:
                                raise APIStatusError(200, payload)  # a failure after the header: not retried
                            delivered += 1
                            yield event
                        raise httpx.RemoteProtocolError("the stream ended without [DONE]")
            except httpx.TransportError as e:
                if delivered:
                    raise StreamInterrupted(f"the stream broke after {delivered} events: {e}") from e
                if last:
                    raise
            await self._wait(attempt, retry_after or None)

    # -- OpenAI endpoints -----------------------------------------------------------------------
    async def completions(self, *, lane: str = "interactive", **body) -> dict:
        return await self.post("/v1/completions", body, lane=lane)

    async def chat(self, *, lane: str = "interactive", **body) -> dict:
        return await self.post("/v1/chat/completions", body, lane=lane)

    def stream_completions(self, *, lane: str = "interactive", **body) -> AsyncIterator[dict]:
        return self.stream("/v1/completions", body, lane=lane)

    def stream_chat(self, *, lane: str = "interactive", **body) -> AsyncIterator[dict]:
        return self.stream("/v1/chat/completions", body, lane=lane)
