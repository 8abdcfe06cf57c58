"""Streaming OpenAI-compatible client: one request in, one ``RequestRecord`` out.

Timing follows ``vllm bench serve``: TTFT is send -> first chunk with content, ITL
the gaps between content chunks, latency send -> last content chunk. Chunks without
content (role headers, the finish marker, the usage report) carry no token, so they
never start or split a timing interval.

Every request asks for ``stream_options: {include_usage, continuous_usage_stats}``
(vLLM's names). A server that reports usage in every chunk (vLLM does) gives exact
per-token ITL: a chunk that carries k tokens after a gap g counts as k gaps of g/k.
Otherwise each content chunk counts as one token for ITL, and the final usage report
gives the exact output count (without one: the tokenizer's count of the text, else
the number of chunks; ``output_counts`` in the result says which).

A request succeeds only when the stream says it is finished (a ``finish_reason`` or
``data: [DONE]``) after at least one token (a finish chunk counts as the first token when
no text came before it: the tokens decoded to nothing); anything else is a failure with a reason
"Kind: detail" (``HTTP 500: ...``, ``ClientPayloadError: ...``, ``IncompleteStream``).
A 429 or 503 with ``Retry-After`` is sent again after that delay (up to three times); the
wait counts in the request's latency.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import random
import time
from dataclasses import dataclass, field, fields

import aiohttp

from expresslane.backoff import Backoff, parse_retry_after
from expresslane.bench.records import RequestRecord
from expresslane.config.bench import ClientOptions
from expresslane.config.flags import default_of

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
# Generous like vLLM's client: a benchmark must see slow requests, not cut them off.
TIMEOUT = aiohttp.ClientTimeout(total=6 * 60 * 60)
# A server that refuses with Retry-After is asked again after that delay (plus jitter), a few times;
# any other refusal is a failure of the request, as a benchmark must see it.
RETRY_AFTER_ATTEMPTS = 3
_BACKOFF = Backoff(max_wait=60.0)
_RNG = random.Random()


@dataclass(frozen=True, slots=True)
class Endpoint:
    """A resolved target: the model is known, the server's context length if it said."""

    base_url: str
    model: str
    kind: str = default_of(ClientOptions, "endpoint")
    ignore_eos: bool = default_of(ClientOptions, "ignore_eos")
    headers: dict[str, str] = field(default_factory=dict)
    body: dict = field(default_factory=dict)  # sampling, then --extra-body
    max_model_len: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {', '.join(ENDPOINTS)}, got {self.kind!r}")
        object.__setattr__(self, "base_url", server_root(self.base_url))

    @property
    def url(self) -> str:
        return self.base_url + ENDPOINTS[self.kind]


def server_root(base_url: str) -> str:
    root = base_url.rstrip("/")
    return root[:-3] if root.endswith("/v1") else root


def parse_header(item: str) -> tuple[str, str]:
    """``Name:value`` (curl) or ``Name=value`` (vLLM); a header name holds neither sign."""
    cut = min((i for i in (item.find(":"), item.find("=")) if i > 0), default=-1)
    if cut < 0 or not item[:cut].strip():
        raise ValueError(f"bad header {item!r}: expected NAME:VALUE")
    return item[:cut].strip(), item[cut + 1:].strip()


def parse_extra_body(text: str | None) -> dict:
    if not text:
        return {}
    try:
        body = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--extra-body is not JSON: {e}") from None
    if not isinstance(body, dict):
        raise ValueError(f"--extra-body must be a JSON object, got {text!r}")
    return body


def api_key_from_env(given: str | None) -> str | None:
    return given if given is not None else os.environ.get("OPENAI_API_KEY") or None


def make_session() -> aiohttp.ClientSession:
    # limit=0: the benchmark, not the connection pool, decides how many are in flight.
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=TIMEOUT)


def request_headers(opts: ClientOptions) -> dict[str, str]:
    """The API key (the flag, else $OPENAI_API_KEY) and the ``--header`` items."""
    key = api_key_from_env(opts.api_key)
    return {**({"Authorization": f"Bearer {key}"} if key else {}), **dict(parse_header(h) for h in opts.header)}


def shared_body(opts: ClientOptions) -> dict:
    """What every request body carries: the sampling options given, then ``--extra-body``."""
    sampling = {f.name: getattr(opts.sampling, f.name) for f in fields(opts.sampling)}
    return {**{k: v for k, v in sampling.items() if v is not None}, **parse_extra_body(opts.extra_body)}


async def connect(session: aiohttp.ClientSession, opts: ClientOptions) -> Endpoint:
    """Resolve the model and the context length from ``GET /v1/models``."""
    if not opts.base_url:
        raise ValueError("no server: pass --base-url")
    headers, body = request_headers(opts), shared_body(opts)
    root = server_root(opts.base_url)
    try:
        card = await model_card(session, root, headers, opts.model)
    except RuntimeError:
        if opts.model is None:
            raise
        card = {}  # the model is given: run, and let the requests report what fails
    model = opts.model or card["id"]
    max_len = card.get("max_model_len")
    return Endpoint(root, model, opts.endpoint, opts.ignore_eos, headers, body,
                    max_len if isinstance(max_len, int) and max_len > 0 else None)


async def model_card(session: aiohttp.ClientSession, root: str, headers: dict,
                     model: str | None) -> dict:
    """The ``/v1/models`` entry of ``model`` (default: the first listed)."""
    url = root + "/v1/models"
    try:
        async with session.get(url, headers=headers) as resp:
            if resp.status in (401, 403):
                raise RuntimeError(f"{url}: HTTP {resp.status}: {error_message(await resp.text())}; "
                                   "pass --api-key KEY (or set OPENAI_API_KEY)")
            resp.raise_for_status()
            cards = (await resp.json())["data"]
            return next((c for c in cards if c["id"] == model), cards[0])
    except (aiohttp.ClientError, KeyError, IndexError, TypeError, ValueError) as e:
        raise RuntimeError(f"cannot list models at {url} ({e}); pass --model") from None


def request_body(ep: Endpoint, prompt: str, output_len: int, lane: str | None = None,
                 priority: int | None = None) -> dict:
    body: dict = {
        "model": ep.model,
        "max_tokens": output_len,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    if ep.kind == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if ep.ignore_eos:
        body["ignore_eos"] = True  # vLLM-style extra field; others ignore it
    if lane is not None:
        body["lane"] = lane
    if priority is not None:
        body["priority"] = priority
    return body | ep.body


def chunk_text(ep: Endpoint, choice: dict) -> str:
    if ep.kind == "chat":
        delta = choice.get("delta") or {}
        return delta.get("content") or delta.get("reasoning_content") or ""
    return choice.get("text") or ""


async def send_request(session: aiohttp.ClientSession, ep: Endpoint, prompt: str, prompt_len: int,
                       output_len: int, length_class: str = "short", lane: str | None = None,
                       priority: int | None = None) -> RequestRecord:
    rec = RequestRecord(input_len=prompt_len, length_class=length_class, lane=lane)
    body = request_body(ep, prompt, output_len, lane, priority)
    rec.start = time.perf_counter()
    try:
        for attempt in itertools.count():
            async with session.post(ep.url, json=body, headers=ep.headers) as resp:
                wait = retry_wait(resp.status, resp.headers.get("Retry-After"), attempt)
                if wait is None:
                    if resp.status != 200:
                        rec.error = f"HTTP {resp.status}: {error_message(await resp.text())}"
                    else:
                        await read_stream(resp, ep, rec)
                    break
            await asyncio.sleep(wait)  # the wait counts in the request's latency, as its user feels it
    except Exception as e:  # noqa: BLE001 - every failure is recorded with its reason
        rec.error = f"{type(e).__name__}: {e}"
    rec.end = time.perf_counter()
    if rec.error:  # a failed request keeps its reason, not partial counts or timings
        rec.success, rec.output_len, rec.ttft, rec.itl, rec.text = False, 0, 0.0, [], ""
    return rec


def retry_wait(status: int, retry_after: str | None, attempt: int) -> float | None:
    """Seconds to wait before sending again: only for a 429/503 that says when (``Retry-After``), a few times."""
    if status not in (429, 503) or retry_after is None or attempt >= RETRY_AFTER_ATTEMPTS:
        return None
    if parse_retry_after(retry_after) is None:
        return None
    return _BACKOFF.delay(attempt, retry_after, _RNG)


async def read_stream(resp: aiohttp.ClientResponse, ep: Endpoint, rec: RequestRecord) -> None:
    """Parse the SSE stream into ``rec``; sets ``rec.error`` when it did not finish."""
    chunks = 0
    finished = False
    last = rec.start
    counted: int | None = None  # completion tokens so far, from per-chunk usage
    usage_out: int | None = None
    text: list[str] = []
    async for raw in resp.content:
        line = raw.decode("utf-8").strip()
        if not line.startswith("data:"):
            continue  # blank separators, comments, "event:" lines
        payload = line[5:].strip()
        if payload == "[DONE]":
            finished = True
            break
        data = json.loads(payload)
        if "error" in data:
            rec.error = f"StreamError: {error_message(payload)}"
            return
        usage = data.get("usage") or {}
        if isinstance(data.get("metrics"), dict):  # expresslane's return_metrics
            rec.server_metrics = data["metrics"]
        if usage:
            usage_out = usage.get("completion_tokens", usage_out)
            rec.input_len = usage.get("prompt_tokens") or rec.input_len
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
            rec.cached_tokens = cached if isinstance(cached, int) else rec.cached_tokens
        for choice in data.get("choices") or []:
            piece = chunk_text(ep, choice)
            # A finish with no text before it still reports generated tokens (ones that
            # decode to nothing): their first arrival is this chunk.
            if piece or (chunks == 0 and choice.get("finish_reason") is not None):
                now = time.perf_counter()
                new = 1
                if isinstance(usage.get("completion_tokens"), int):  # continuous usage stats
                    new = max(1, usage["completion_tokens"] - (counted or 0))
                    counted = usage["completion_tokens"]
                if chunks == 0:
                    rec.ttft = now - rec.start
                else:
                    rec.itl.extend([(now - last) / new] * new)
                last = now
                chunks += 1
                text.append(piece)
            finished = finished or choice.get("finish_reason") is not None
    if not finished:
        rec.error = f"IncompleteStream: stream ended after {chunks} token chunks without finishing"
    elif chunks == 0:
        rec.error = "NoContent: stream finished without any token"
    else:
        rec.success = True
        rec.latency = last - rec.start
        rec.text = "".join(text)
        rec.output_len, rec.output_count = ((usage_out, "usage") if usage_out
                                            else (chunks, "chunks"))


def error_message(body: str) -> str:
    """The message of an OpenAI error body, else the raw text (truncated)."""
    try:
        err = json.loads(body).get("error")
        msg = err.get("message") if isinstance(err, dict) else err
    except (json.JSONDecodeError, AttributeError):
        msg = None
    return str(msg or body.strip() or "no body")[:300]
