"""Streaming OpenAI-compatible client: one request in, one ``RequestRecord`` out.

Timing follows ``vllm bench serve``: TTFT is send -> first chunk with content, ITL
the gaps between content chunks, latency send -> last content chunk. Chunks without
content (role headers, the finish marker, the usage report) carry no token, so they
never start or split a timing interval.

A request succeeds only when the stream says it is finished (a ``finish_reason`` or
``data: [DONE]``) after at least one token; anything else is a failure with a reason
"Kind: detail" (``HTTP 500: ...``, ``ClientPayloadError: ...``, ``IncompleteStream``).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import aiohttp
import numpy as np

from expresslane.bench.datasets import SampleRequest, word_prompt
from expresslane.bench.records import RequestRecord

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
# Generous like vLLM's client: a benchmark must see slow requests, not cut them off.
TIMEOUT = aiohttp.ClientTimeout(total=6 * 60 * 60)


@dataclass(frozen=True, slots=True)
class Endpoint:
    base_url: str  # server root; a trailing /v1 is accepted and removed
    model: str
    kind: str = "completions"  # "completions" | "chat"
    ignore_eos: bool = False

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


def make_session() -> aiohttp.ClientSession:
    # limit=0: the benchmark, not the connection pool, decides how many are in flight.
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=TIMEOUT)


def request_body(ep: Endpoint, req: SampleRequest) -> dict:
    body: dict = {
        "model": ep.model,
        "max_tokens": req.output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ep.kind == "chat":
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    if ep.ignore_eos:
        body["ignore_eos"] = True  # vLLM-style extra field; others ignore it
    if req.lane is not None:
        body["lane"] = req.lane
    if req.priority is not None:
        body["priority"] = req.priority
    return body


def chunk_text(ep: Endpoint, choice: dict) -> str:
    if ep.kind == "chat":
        delta = choice.get("delta") or {}
        return delta.get("content") or delta.get("reasoning_content") or ""
    return choice.get("text") or ""


async def send_request(session: aiohttp.ClientSession, ep: Endpoint,
                       req: SampleRequest) -> RequestRecord:
    rec = RequestRecord(input_len=req.prompt_len, length_class=req.length_class, lane=req.lane)
    rec.start = time.perf_counter()
    try:
        async with session.post(ep.url, json=request_body(ep, req)) as resp:
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}: {error_message(await resp.text())}"
            else:
                await read_stream(resp, ep, rec)
    except Exception as e:  # noqa: BLE001 - every failure is recorded with its reason
        rec.error = f"{type(e).__name__}: {e}"
    rec.end = time.perf_counter()
    if rec.error:  # a failed request keeps its reason, not partial counts or timings
        rec.success, rec.output_len, rec.ttft, rec.itl = False, 0, 0.0, []
    return rec


async def read_stream(resp: aiohttp.ClientResponse, ep: Endpoint, rec: RequestRecord) -> None:
    """Parse the SSE stream into ``rec``; sets ``rec.error`` when it did not finish."""
    chunks = 0
    finished = False
    last = rec.start
    usage_out: int | None = None
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
        if usage := data.get("usage"):
            usage_out = usage.get("completion_tokens", usage_out)
            rec.input_len = usage.get("prompt_tokens") or rec.input_len
        for choice in data.get("choices") or []:
            if chunk_text(ep, choice):
                now = time.perf_counter()
                if chunks == 0:
                    rec.ttft = now - rec.start
                else:
                    rec.itl.append(now - last)
                last = now
                chunks += 1
            finished = finished or choice.get("finish_reason") is not None
    if not finished:
        rec.error = f"IncompleteStream: stream ended after {chunks} token chunks without finishing"
    elif chunks == 0:
        rec.error = "NoContent: stream finished without any token"
    else:
        rec.success = True
        rec.latency = last - rec.start
        rec.output_len = usage_out if usage_out else chunks


def error_message(body: str) -> str:
    """The message of an OpenAI error body, else the raw text (truncated)."""
    try:
        err = json.loads(body).get("error")
        msg = err.get("message") if isinstance(err, dict) else err
    except (json.JSONDecodeError, AttributeError):
        msg = None
    return str(msg or body.strip() or "no body")[:200]


async def fetch_model(session: aiohttp.ClientSession, base_url: str) -> str:
    """The first model the server lists (``GET /v1/models``)."""
    url = server_root(base_url) + "/v1/models"
    try:
        async with session.get(url) as resp:
            resp.raise_for_status()
            return (await resp.json())["data"][0]["id"]
    except (aiohttp.ClientError, KeyError, IndexError, ValueError) as e:
        raise RuntimeError(f"cannot list models at {url} ({e}); pass --model") from None


async def tokens_per_word(session: aiohttp.ClientSession, base_url: str,
                          model: str) -> float | None:
    """Tokens per synthetic word from the server's ``/tokenize``; None if unsupported."""
    n_words = 256
    prompt = word_prompt(np.random.default_rng(0), n_words, 1.0)
    try:
        async with session.post(server_root(base_url) + "/tokenize",
                                json={"model": model, "prompt": prompt}) as resp:
            if resp.status != 200:
                return None
            data = await resp.json()
    except (aiohttp.ClientError, ValueError):
        return None
    count = data.get("count") if isinstance(data, dict) else None
    if count is None and isinstance(data, dict) and isinstance(data.get("tokens"), list):
        count = len(data["tokens"])
    return count / n_words if count else None
