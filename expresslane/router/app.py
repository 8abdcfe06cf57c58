"""The router's HTTP side: OpenAI-compatible routes proxied to replicas picked by policy.py.

- Every replica's ``GET /load`` is polled every ``health_interval`` seconds (timeout the
  same); a failed poll, or a refused connection while proxying, takes it out at once (so a
  dead replica is out within two intervals); a successful poll brings it back.
- A request is sent to the chosen replica; when that fails before the replica has sent
  any token (connection refused or reset, a 503 from a replica that is draining or
  restarting, a stream that ends before its first event), it goes to the next best
  replica. Once a token has reached the client it cannot move: a stream cut by a dying
  replica ends with an SSE error event and ``[DONE]``.
- Authorization headers pass through: the replicas check API keys.
- LoRA adapters loaded or unloaded at run time (vLLM's ``/v1/load_lora_adapter`` and
  ``/v1/unload_lora_adapter``) go to every ready replica, so any of them serves any adapter. A
  load some replicas refuse is taken back from those that took it. The router keeps the changes
  it passed on and sends them to a replica that becomes ready without them (it was starting,
  down or restarted), before any request is routed to it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from expresslane.router.metrics import RouterMetrics
from expresslane.router.policy import Load, Replica, choose, estimate_tokens, predict_ttft

log = logging.getLogger(__name__)

_RETRYABLE_STATUS = (502, 503)  # a replica draining, restarting or not ready: try another
_PASS_HEADERS = ("authorization", "content-type", "x-request-id")


class Router:
    def __init__(self, backends: list[str], health_interval: float):
        if not backends:
            raise ValueError("the router needs at least one --backend URL")
        self.replicas = [Replica(url.rstrip("/")) for url in backends]
        self.health_interval = health_interval
        self.metrics = RouterMetrics([r.url for r in self.replicas])
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0))
        self._poller: asyncio.Task | None = None
        self.loras: dict[str, tuple[bytes, dict]] = {}  # loaded through the router: name -> body, headers
        self.unloaded: dict[str, dict] = {}  # unloaded through the router since: name -> headers
        self._synced: set[str] = set()  # replicas (URLs) that hold every change so far
        self._lora_lock = asyncio.Lock()  # one load, unload or sync at a time

    # -- health ---------------------------------------------------------------------------------
    async def start(self) -> None:
        await self.poll_all()
        self._poller = asyncio.create_task(self._poll_forever())

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
        await self.http.aclose()

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval)
            await self.poll_all()

    async def poll_all(self) -> None:
        await asyncio.gather(*(self._poll(r) for r in self.replicas))

    async def _poll(self, replica: Replica) -> None:
        try:
            resp = await self.http.get(replica.url + "/load", timeout=self.health_interval)
            resp.raise_for_status()
            load = Load.from_json(resp.json())
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
            self._mark_down(replica, f"/load failed: {e!r}")
            return
        if not replica.healthy:
            log.info("replica %s is up (%s)", replica.url, load.state)
            replica.forget_prefixes()  # whatever it held before it went away is gone
        if load.state == "ready" and replica.url not in self._synced and not await self._sync_loras(replica):
            return  # gone again (marked down): the next poll tries again
        replica.healthy, replica.load = True, load
        self.metrics.replica_load(replica)

    def _mark_down(self, replica: Replica, why: str) -> None:
        if replica.healthy:
            log.warning("replica %s is out: %s", replica.url, why)
        replica.healthy = False
        self._synced.discard(replica.url)
        replica.forget_prefixes()
        self.metrics.replica_load(replica)

    # -- LoRA adapters ----------------------------------------------------------------------------
    async def change_lora(self, request: Request, path: str) -> Response:
        """A load or an unload, sent to every ready replica at once (the rest get it when ready)."""
        body = await request.body()
        try:
            name = json.loads(body)["lora_name"]
        except (ValueError, KeyError, TypeError):
            name = None
        headers = _passed_headers(request)
        load = path == "/v1/load_lora_adapter"
        async with self._lora_lock:
            targets = [r for r in self.replicas if r.available]
            answers = await asyncio.gather(*(self._post(r, path, body, headers) for r in targets))
            answered = [(r, a) for r, a in zip(targets, answers) if a is not None]
            if not answered:
                return _error(503, "no replica is available; retry later", "service_unavailable",
                              "no_replica_available", retry_after=1)
            took = [(r, a) for r, a in answered if a.status_code < 300 or load and _lora_exists(a)]
            if load and len(took) < len(answered):  # refused somewhere: taken back where it was taken
                undo = _unload_body(name)
                await asyncio.gather(*(self._post(r, "/v1/unload_lora_adapter", undo, headers)
                                       for r, a in took if a.status_code < 300))
                refusal = next(a for _, a in answered if a.status_code >= 300 and not _lora_exists(a))
                return Response(refusal.content, refusal.status_code, _reply_headers(refusal))
            ok = next((a for _, a in answered if a.status_code < 300), None)
            if ok is not None and isinstance(name, str):
                if load:
                    self.loras[name] = (body, headers)
                    self.unloaded.pop(name, None)
                else:
                    self.loras.pop(name, None)
                    self.unloaded[name] = headers
                self._synced &= {r.url for r, _ in answered}  # the others get it when ready
            reply = ok or answered[0][1]
            return Response(reply.content, reply.status_code, _reply_headers(reply))

    async def _sync_loras(self, replica: Replica) -> bool:
        """The changes passed on so far, to a replica about to be routed to; False if it could not
        be reached. It counts as synced unless one answered with a server error."""
        async with self._lora_lock:
            changes = [("/v1/unload_lora_adapter", name, _unload_body(name), headers)
                       for name, headers in self.unloaded.items()]
            changes += [("/v1/load_lora_adapter", name, body, headers) for name, (body, headers) in self.loras.items()]
            complete = True
            for path, name, body, headers in changes:
                answer = await self._post(replica, path, body, headers)
                if answer is None:
                    return False
                complete &= answer.status_code < 500
                if answer.status_code >= 300 and not _lora_exists(answer) and answer.status_code != 404:
                    log.warning("replica %s refused %s of the LoRA adapter %r: %s", replica.url, path, name,
                                answer.text[:200])
            if complete:
                self._synced.add(replica.url)
        return True

    async def _post(self, replica: Replica, path: str, body: bytes, headers: dict) -> httpx.Response | None:
        """None when the replica could not be reached (it is marked down)."""
        try:
            return await self.http.post(replica.url + path, content=body, headers=headers, timeout=120.0)
        except httpx.TransportError as e:
            self._mark_down(replica, f"{type(e).__name__} on POST {path}")
            return None

    # -- requests -------------------------------------------------------------------------------
    async def proxy(self, request: Request, path: str) -> Response:
        body = await request.body()
        try:
            data = json.loads(body)
            if not isinstance(data, dict):
                raise ValueError("not an object")
        except ValueError as e:
            return _error(400, f"the request body is not a JSON object ({e})", "invalid_request_error")
        lane = _lane(data)
        text, num_tokens = _prompt_text(data)
        headers = _passed_headers(request)
        stream = bool(data.get("stream"))
        tried: set[str] = set()
        last: Response | None = None
        t0 = time.monotonic()
        while True:
            candidates = [r for r in self.replicas if r.url not in tried]
            replica = choose(candidates, lane, text, num_tokens)
            if replica is None:
                break
            tried.add(replica.url)
            tokens = num_tokens if num_tokens is not None else estimate_tokens(text)
            self.metrics.routed(replica.url, lane, predict_ttft(replica, tokens))
            replica.pending[lane] = replica.pending.get(lane, 0) + tokens
            try:
                result = await self._send(replica, path, body, headers, stream, lane, tokens, t0)
            except _NotStarted as e:
                self.metrics.retried(replica.url)
                last = e.response
                continue
            return result
        if last is not None:
            self.metrics.failed("no_replica_accepted")
            return last
        self.metrics.failed("no_replica_available")
        return _error(503, "no replica is available; retry later", "service_unavailable", "no_replica_available",
                      retry_after=1)

    async def _send(self, replica: Replica, path: str, body: bytes, headers: dict, stream: bool, lane: str,
                    tokens: int, t0: float) -> Response:
        """Send to one replica; raises _NotStarted when nothing reached the client and another
        replica may take the request."""
        settled = False

        def settle() -> None:
            """The request no longer waits at this replica (it answered, or failed)."""
            nonlocal settled
            if not settled:
                settled = True
                replica.pending[lane] = max(0, replica.pending.get(lane, 0) - tokens)

        req = self.http.build_request("POST", replica.url + path, content=body, headers=headers)
        try:
            resp = await self.http.send(req, stream=True)
        except httpx.TransportError as e:
            settle()
            self._mark_down(replica, f"{type(e).__name__} while sending a request")
            raise _NotStarted(None) from e
        if resp.status_code in _RETRYABLE_STATUS:
            content = await resp.aread()
            await resp.aclose()
            settle()
            raise _NotStarted(Response(content, resp.status_code, _reply_headers(resp)))
        chunks = resp.aiter_raw()
        try:
            first = await chunks.__anext__()
        except StopAsyncIteration:
            first = b""
        except httpx.TransportError as e:  # died before its first byte: nothing sent, try another
            await resp.aclose()
            settle()
            self._mark_down(replica, f"{type(e).__name__} before the first byte")
            raise _NotStarted(None) from e
        settle()
        self.metrics.first_byte(replica.url, lane, time.monotonic() - t0)
        if not stream:
            try:
                rest = b"".join([c async for c in chunks])
            except httpx.TransportError as e:  # the client has received nothing yet: retry
                self._mark_down(replica, f"{type(e).__name__} mid-response")
                raise _NotStarted(None) from e
            finally:
                await resp.aclose()
            return Response(first + rest, resp.status_code, _reply_headers(resp))

        async def relay():
            try:
                yield first
                async for chunk in chunks:
                    yield chunk
            except httpx.TransportError as e:
                self._mark_down(replica, f"{type(e).__name__} mid-stream")
                self.metrics.failed("replica_lost_mid_stream")
                err = {"error": {"message": "the replica serving this stream went away", "type": "internal_error",
                                 "param": None, "code": "replica_lost"}}
                yield f"data: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode()
            finally:
                await resp.aclose()

        return StreamingResponse(relay(), resp.status_code, _reply_headers(resp))

    async def forward_get(self, path: str, request: Request) -> Response:
        headers = _passed_headers(request)
        for replica in [r for r in self.replicas if r.available]:
            try:
                resp = await self.http.get(replica.url + path, headers=headers, timeout=10.0)
            except httpx.TransportError as e:
                self._mark_down(replica, f"{type(e).__name__} on GET {path}")
                continue
            return Response(resp.content, resp.status_code, _reply_headers(resp))
        return _error(503, "no replica is available; retry later", "service_unavailable", "no_replica_available",
                      retry_after=1)


class _NotStarted(Exception):
    """The replica failed before the client got anything; `response`: its answer, if any."""

    def __init__(self, response: Response | None):
        super().__init__()
        self.response = response


def _reply_headers(resp: httpx.Response) -> dict[str, str]:
    keep = ("content-type", "retry-after", "x-request-id")
    return {k: v for k, v in resp.headers.items() if k.lower() in keep}


def _error(status: int, message: str, type_: str, code: str | None = None, retry_after: int | None = None):
    headers = {"Retry-After": str(retry_after)} if retry_after else {}
    return JSONResponse({"error": {"message": message, "type": type_, "param": None, "code": code}}, status,
                        headers=headers)


def _passed_headers(request: Request) -> dict[str, str]:
    return {k: v for k, v in request.headers.items() if k.lower() in _PASS_HEADERS}


def _unload_body(name: object) -> bytes:
    return json.dumps({"lora_name": name}).encode()


def _lora_exists(answer: httpx.Response) -> bool:
    """A replica's refusal of a load because it holds that adapter already."""
    try:
        return answer.status_code == 400 and answer.json()["error"]["code"] == "lora_exists"
    except (ValueError, KeyError, TypeError):
        return False


def _lane(data: dict) -> str:
    lane = data.get("lane")
    if lane in ("interactive", "batch"):
        return lane
    priority = data.get("priority")
    return "batch" if isinstance(priority, int) and priority > 0 else "interactive"


def _prompt_text(data: dict) -> tuple[str, int | None]:
    """What the prefix hashes cover, and the exact token count when the prompt is token ids."""
    messages = data.get("messages")
    given = data.get("input")
    if isinstance(given, list) and given and not isinstance(given[0], dict):  # embeddings' inputs
        if all(isinstance(t, int) for t in given):
            return " ".join(map(str, given)), len(given)
        if all(isinstance(p, list) for p in given):
            return "\n".join(" ".join(map(str, p)) for p in given), sum(map(len, given))
        return "\n".join(map(str, given)), None
    if "input" in data and not isinstance(messages, list):  # the Responses API: its messages as chat's
        messages = ([{"role": "system", "content": data["instructions"]}] if isinstance(data.get("instructions"), str)
                    else []) + ([{"role": "user", "content": given}] if isinstance(given, str)
                                else given if isinstance(given, list) else [])
    if isinstance(messages, list):
        parts = []
        for m in messages:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, list):
                content = " ".join(str(c.get("text", "")) for c in content if isinstance(c, dict))
            parts.append(f"{m.get('role') if isinstance(m, dict) else ''}: {content}\n")
        return "".join(parts), None
    prompt = data.get("prompt", data.get("text", ""))
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return " ".join(map(str, prompt)), len(prompt)
    if isinstance(prompt, list):
        return "\n".join(map(str, prompt)), None
    return str(prompt), None


POOLING_ROUTES = ("/v1/embeddings", "/pooling", "/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank")


def build_router_app(router: Router) -> FastAPI:
    app = FastAPI(title="expresslane router")

    # the generation routes, and a pooling server's (its replicas started with --runner pooling)
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/generate", "/tokenize", "/detokenize",
                 *POOLING_ROUTES):
        async def route(request: Request, _path: str = path) -> Response:
            return await router.proxy(request, _path)
        app.add_api_route(path, route, methods=["POST"])

    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        async def lora_route(request: Request, _path: str = path) -> Response:
            return await router.change_lora(request, _path)
        app.add_api_route(path, lora_route, methods=["POST"])

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await router.forward_get("/v1/models", request)

    @app.get("/v1/models/{model:path}")
    async def model(request: Request, model: str) -> Response:
        return await router.forward_get(request.url.path, request)

    @app.get("/health")
    async def health() -> Response:
        up = [r.url for r in router.replicas if r.available]
        body = {"status": "ok" if up else "unavailable", "replicas": {r.url: r.load.state if r.healthy else "down"
                                                                        for r in router.replicas}}
        return JSONResponse(body, 200 if up else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(router.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
