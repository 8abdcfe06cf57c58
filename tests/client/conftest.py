"""A real HTTP server (aiohttp, 127.0.0.1, a free port) that answers from a script."""

from __future__ import annotations

import asyncio
import json
import socket
import threading

import pytest
from aiohttp import web


class ScriptedServer:
    """Each POST takes the next step of ``script``: ("error", status, headers), ("json", body),
    ("stream", events, complete) — complete=False closes the connection after the events."""

    def __init__(self):
        self.script: list[tuple] = []
        self.bodies: list[dict] = []
        self._loop = asyncio.new_event_loop()
        app = web.Application()
        app.router.add_post("/v1/{tail:.*}", self.handle)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self._runner = web.AppRunner(app, access_log=None)
        threading.Thread(target=self._loop.run_forever, daemon=True).start()

        async def serve():
            await self._runner.setup()
            await web.SockSite(self._runner, sock).start()

        asyncio.run_coroutine_threadsafe(serve(), self._loop).result()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.bodies.append(await request.json())
        step = self.script.pop(0)
        if step[0] == "error":
            return web.json_response({"error": {"message": "busy", "type": "x", "param": None, "code": None}},
                                     status=step[1], headers=step[2])
        if step[0] == "json":
            return web.json_response(step[1])
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for event in step[1]:
            await resp.write(b"data: " + json.dumps(event).encode() + b"\n\n")
        if step[2]:
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        else:
            request.transport.close()  # cut mid-stream
        return resp

    def stop(self):
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)


@pytest.fixture(scope="module")
def scripted():
    s = ScriptedServer()
    yield s
    s.stop()
