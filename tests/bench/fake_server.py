"""An OpenAI-compatible streaming server with programmed timing and injected failures.

It runs on 127.0.0.1 on a free port, in a thread with its own event loop. Token k of
a request is written at ``t0 + ttft + k * itl`` (absolute deadlines, so sleep jitter
never accumulates), where t0 is when the request got one of ``capacity`` slots.
Requests are numbered from 1 in arrival order: every ``fail_every``-th gets HTTP 500,
every ``drop_every``-th has its connection dropped after two tokens. With
``prefill_per_token``, prompts are first "prefilled" one at a time, first come first
served, for that many seconds per prompt token: short prompts wait behind long ones.
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
    prefill_per_token: float = 0.0  # seconds per prompt token, one prompt at a time
    tokens_per_word: float | None = 1.0  # /tokenize answers 404 when None
    usage: bool = True  # honour stream_options.include_usage


@dataclass
class FakeServer:
    behavior: Behavior = field(default_factory=Behavior)
    bodies: list[dict] = field(default_factory=list)  # every generation request received

    def __post_init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self._slots: asyncio.Semaphore | None = None
        self._prefill = asyncio.Lock()
        self.base_url = ""

    def configure(self, behavior: Behavior) -> None:
        """Change behaviour between runs; resets the request numbering."""
        self.behavior = behavior
        self.bodies.clear()
        # asyncio primitives bind to the loop that first awaits them: the server's.
        self._slots = asyncio.Semaphore(behavior.capacity) if behavior.capacity else None

    def start(self) -> "FakeServer":
        app = web.Application()
        app.router.add_post("/v1/completions", self.generate)
        app.router.add_post("/v1/chat/completions", self.generate)
        app.router.add_post("/tokenize", self.tokenize)
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

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    def count_tokens(self, text: str) -> int:
        return max(1, round(len(text.split()) * (self.behavior.tokens_per_word or 1.0)))

    async def tokenize(self, request: web.Request) -> web.Response:
        if self.behavior.tokens_per_word is None:
            raise web.HTTPNotFound()
        n = self.count_tokens((await request.json())["prompt"])
        return web.json_response({"count": n, "tokens": list(range(n))})

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        n, b = len(self.bodies), self.behavior
        if b.fail_every and n % b.fail_every == 0:
            return web.json_response({"error": {"message": "injected failure", "type":
                                                "InternalServerError", "param": None,
                                                "code": 500}}, status=500)
        drop = bool(b.drop_every and n % b.drop_every == 0)
        if self._slots is None:
            return await self.stream(request, body, drop)
        async with self._slots:
            return await self.stream(request, body, drop)

    async def stream(self, request: web.Request, body: dict, drop: bool) -> web.StreamResponse:
        b = self.behavior
        chat = "messages" in body
        prompt = body["messages"][0]["content"] if chat else body["prompt"]
        if b.prefill_per_token:
            async with self._prefill:
                await asyncio.sleep(self.count_tokens(prompt) * b.prefill_per_token)
        t0 = time.perf_counter()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        max_tokens = body["max_tokens"]
        for k in range(max_tokens):
            await asyncio.sleep(max(0.0, t0 + b.ttft + k * b.itl - time.perf_counter()))
            text = f" tok{k}"
            choice = ({"index": 0, "delta": {"content": text}, "finish_reason": None} if chat
                      else {"index": 0, "text": text, "finish_reason": None})
            await send(resp, {"id": "x", "choices": [choice]})
            if drop and k == 1:
                request.transport.abort()  # the connection dies mid-stream
                return resp
        last = ({"index": 0, "delta": {}, "finish_reason": "length"} if chat
                else {"index": 0, "text": "", "finish_reason": "length"})
        await send(resp, {"id": "x", "choices": [last]})
        if b.usage and (body.get("stream_options") or {}).get("include_usage"):
            prompt_tokens = self.count_tokens(prompt) + (CHAT_TEMPLATE_TOKENS if chat else 0)
            await send(resp, {"id": "x", "choices": [], "usage": {
                "prompt_tokens": prompt_tokens, "completion_tokens": max_tokens,
                "total_tokens": prompt_tokens + max_tokens}})
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


async def send(resp: web.StreamResponse, data: dict) -> None:
    await resp.write(f"data: {json.dumps(data)}\n\n".encode())
