"""An OpenAI-compatible streaming server with programmed timing and injected failures.

It runs on 127.0.0.1 on a free port, in a thread with its own event loop. Token k of
a request is written at ``t0 + ttft + k * itl`` (absolute deadlines, so sleep jitter
never accumulates), where t0 is when the request got one of ``capacity`` slots.
Requests are numbered from 1 in arrival order: every ``fail_every``-th gets HTTP 500,
every ``drop_every``-th has its connection dropped after two tokens. With
``prefill_per_token``, prompts are first "prefilled" one at a time, first come first
served, for that many seconds per prompt token: short prompts wait behind long ones.

Its tokenizer is one token per word plus a BOS token (``/tokenize``, ``/detokenize``,
usage, and a 400 when a prompt and its ``max_tokens`` exceed ``max_model_len``).
``tokens_per_chunk`` sends that many tokens in each content chunk; ``continuous_usage``
honours ``stream_options.continuous_usage_stats`` (usage in every chunk, as vLLM).
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from dataclasses import dataclass, field

from aiohttp import web

MODEL = "fake-model"
CHAT_TEMPLATE_TOKENS = 5


@dataclass
class Behavior:
    ttft: float = 0.1
    itl: float = 0.02
    fail_every: int = 0
    drop_every: int = 0
    capacity: int = 0  # requests served at once; the rest wait (0: no limit)
    reject_over_capacity: bool = False  # over capacity: 503 at once instead of waiting
    prefill_per_token: float = 0.0  # seconds per prompt token, one prompt at a time
    tokenize: bool = True  # /tokenize and /detokenize answer 404 when False
    usage: bool = True  # honour stream_options.include_usage
    continuous_usage: bool = False  # honour stream_options.continuous_usage_stats
    tokens_per_chunk: int = 1
    max_model_len: int | None = 4096  # reported in /v1/models (None: not reported, not enforced)
    api_key: str | None = None  # require "Authorization: Bearer KEY"


@dataclass
class FakeServer:
    behavior: Behavior = field(default_factory=Behavior)
    bodies: list[dict] = field(default_factory=list)  # every generation request received
    headers: list[dict] = field(default_factory=list)  # their HTTP headers

    def __post_init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self._slots: asyncio.Semaphore | None = None
        self._prefill = asyncio.Lock()
        self.vocab: dict[str, int] = {}  # word -> token id (0 is BOS)
        self.base_url = ""

    def configure(self, behavior: Behavior) -> None:
        """Change behaviour between runs; resets the request numbering."""
        self.behavior = behavior
        self.bodies.clear()
        self.headers.clear()
        # asyncio primitives bind to the loop that first awaits them: the server's.
        self._slots = asyncio.Semaphore(behavior.capacity) if behavior.capacity else None

    def start(self) -> "FakeServer":
        app = web.Application()
        app.router.add_post("/v1/completions", self.generate)
        app.router.add_post("/v1/chat/completions", self.generate)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/v1/models", self.models)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.base_url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self._runner = web.AppRunner(app, access_log=None)
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()

        async def serve() -> None:
            await self._runner.setup()
            await web.SockSite(self._runner, sock).start()

        asyncio.run_coroutine_threadsafe(serve(), self._loop).result()
        self.configure(self.behavior)
        return self

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def authorized(self, request: web.Request) -> bool:
        key = self.behavior.api_key
        return key is None or request.headers.get("Authorization") == f"Bearer {key}"

    async def models(self, request: web.Request) -> web.Response:
        if not self.authorized(request):
            return error(401, "invalid API key")
        card = {"id": MODEL, "object": "model"}
        if self.behavior.max_model_len is not None:
            card["max_model_len"] = self.behavior.max_model_len
        return web.json_response({"object": "list", "data": [card]})

    @staticmethod
    def count_tokens(text: str) -> int:
        """A prompt's tokens: one per word, and BOS."""
        return 1 + len(text.split())

    async def tokenize(self, request: web.Request) -> web.Response:
        if not self.behavior.tokenize:
            raise web.HTTPNotFound()
        if not self.authorized(request):
            return error(401, "invalid API key")
        body = await request.json()
        if "messages" in body:
            words, specials = body["messages"][0]["content"].split(), 1 + CHAT_TEMPLATE_TOKENS
        else:
            words, specials = body["prompt"].split(), int(body.get("add_special_tokens", True))
        ids = [0] * specials + [self.vocab.setdefault(w, len(self.vocab) + 1) for w in words]
        return web.json_response({"count": len(ids), "tokens": ids,
                                  "max_model_len": self.behavior.max_model_len})

    async def detokenize(self, request: web.Request) -> web.Response:
        if not self.behavior.tokenize:
            raise web.HTTPNotFound()
        if not self.authorized(request):
            return error(401, "invalid API key")
        words = {i: w for w, i in self.vocab.items()}
        ids = (await request.json())["tokens"]
        return web.json_response({"prompt": " ".join(words[i] for i in ids if i in words)})

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.headers.append(dict(request.headers))
        n, b = len(self.bodies), self.behavior
        if not self.authorized(request):
            return error(401, "invalid API key")
        if b.fail_every and n % b.fail_every == 0:
            return error(500, "injected failure")
        prompt = body["messages"][0]["content"] if "messages" in body else body["prompt"]
        prompt_tokens = self.count_tokens(prompt) + (CHAT_TEMPLATE_TOKENS if "messages" in body else 0)
        if b.max_model_len is not None and prompt_tokens + body["max_tokens"] > b.max_model_len:
            return error(400, f"This model's maximum context length is {b.max_model_len} tokens. "
                              f"However, you requested {prompt_tokens + body['max_tokens']} tokens")
        drop = bool(b.drop_every and n % b.drop_every == 0)
        if b.reject_over_capacity and self._slots is not None and self._slots.locked():
            return error(503, "server at capacity")
        if self._slots is None:
            return await self.stream(request, body, drop, prompt_tokens, lambda: None)
        await self._slots.acquire()
        released = False

        def release() -> None:  # before the last token leaves: the client may send again at once
            nonlocal released
            if not released:
                released = True
                self._slots.release()

        try:
            return await self.stream(request, body, drop, prompt_tokens, release)
        finally:
            release()

    async def stream(self, request: web.Request, body: dict, drop: bool, prompt_tokens: int,
                     release) -> web.StreamResponse:
        b = self.behavior
        chat = "messages" in body
        if b.prefill_per_token:
            async with self._prefill:
                await asyncio.sleep(prompt_tokens * b.prefill_per_token)
        t0 = time.perf_counter()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        max_tokens = body["max_tokens"]
        options = body.get("stream_options") or {}
        per_chunk_usage = b.usage and b.continuous_usage and options.get("continuous_usage_stats")

        def usage(done: int) -> dict:
            return {"prompt_tokens": prompt_tokens, "completion_tokens": done,
                    "total_tokens": prompt_tokens + done}

        done, k = 0, 0
        while done < max_tokens:
            await asyncio.sleep(max(0.0, t0 + b.ttft + k * b.itl - time.perf_counter()))
            n = min(b.tokens_per_chunk, max_tokens - done)
            if done + n == max_tokens:
                release()
            text = "".join(f" tok{done + i}" for i in range(n))
            done, k = done + n, k + 1
            choice = ({"index": 0, "delta": {"content": text}, "finish_reason": None} if chat
                      else {"index": 0, "text": text, "finish_reason": None})
            chunk = {"id": "x", "choices": [choice]}
            if per_chunk_usage:
                chunk["usage"] = usage(done)
            await send(resp, chunk)
            if drop and k == 2:
                request.transport.abort()  # the connection dies mid-stream
                return resp
        last = ({"index": 0, "delta": {}, "finish_reason": "length"} if chat
                else {"index": 0, "text": "", "finish_reason": "length"})
        await send(resp, {"id": "x", "choices": [last]})
        if b.usage and options.get("include_usage"):
            await send(resp, {"id": "x", "choices": [], "usage": usage(max_tokens)})
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


def error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "Error", "param": None,
                                        "code": status}}, status=status)


async def send(resp: web.StreamResponse, data: dict) -> None:
    await resp.write(f"data: {json.dumps(data)}\n\n".encode())
