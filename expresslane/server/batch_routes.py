"""The OpenAI Batch API: /v1/files and /v1/batches routes, and the worker that runs batches.

``BatchService`` owns the store (``--batch-store``), the routes and the ``BatchWorker``.
The worker runs each request through this server's own app (in-process ASGI, no
socket), so a batch request meets exactly the validation, admission and errors of an
HTTP request, in the ``batch`` lane: interactive requests keep their SLOs while a
batch drains. A 429/503 answer (overloaded, starting, draining) or a dead engine puts
the request back in the queue for later; any other answer is its result.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from typing import Callable

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CollectorRegistry, Counter, Gauge
from pydantic import BaseModel, ConfigDict, Field, field_validator

from expresslane.batch_api.records import ENDPOINTS, POOLING_ENDPOINTS, FileRecord, Item, ItemResult, new_id
from expresslane.batch_api.registry import default_store_url, open_store
from expresslane.batch_api.store import BatchStore, StoreError, check_upload
from expresslane.batch_api.worker import BatchWorker, Outcome
from expresslane.config.server import BatchApiConfig
from expresslane.server import errors
from expresslane.server.protocol import parse

log = logging.getLogger(__name__)

WORKER_HEADER = "x-expresslane-batch-worker"  # the worker's own calls carry this process's secret
_RETRY_STATUS = (429, 503)


class BatchCreate(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    input_file_id: str = Field(min_length=1)
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None
    output_expires_after: dict | None = None

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        if v is not None and (len(v) > 16 or any(len(k) > 64 or len(x) > 512 for k, x in v.items())):
            raise ValueError("must have at most 16 keys of at most 64 characters, values of at most 512")
        return v


def _store_error(e: StoreError) -> errors.APIError:
    kind = "not_found_error" if e.status == 404 else "invalid_request_error"
    return errors.APIError(e.status, str(e), kind, e.param, e.code)


def _not_found(what: str, ident: str, param: str) -> errors.APIError:
    return errors.APIError(404, f"no {what} with id {ident!r}", "not_found_error", param, "not_found")


def _limit(value: str | None) -> int:
    try:
        n = 20 if value is None else int(value)
    except ValueError:
        n = 0
    if not 1 <= n <= 100:
        raise errors.bad_request(f"'limit' must be an integer in [1, 100], got {value!r}", "limit")
    return n


class BatchMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str):
        self.model_name = model_name
        self.requests = Counter("expresslane:batch_requests", "Batch requests answered by this server, by outcome "
                                "(completed: HTTP 200, failed: any other answer).", ("model_name", "outcome"),
                                registry=registry)
        self.pending = Gauge("expresslane:batch_requests_pending", "Requests of unfinished batches not yet answered "
                             "(all servers sharing the store).", ("model_name",), registry=registry)
        self.open = Gauge("expresslane:batches_open", "Unfinished batches by status.", ("model_name", "status"),
                          registry=registry)
        for outcome in ("completed", "failed"):
            self.requests.labels(model_name, outcome)
        self.pending.labels(model_name).set(0)
        for status in ("in_progress", "cancelling"):
            self.open.labels(model_name, status).set(0)

    def answered(self, item: Item, result: ItemResult) -> None:
        self.requests.labels(self.model_name, "completed" if result.ok else "failed").inc()

    def progress(self, open_batches) -> None:
        self.pending.labels(self.model_name).set(
            sum(b.total - b.completed - b.failed for b in open_batches if b.status == "in_progress"))
        for status in ("in_progress", "cancelling"):
            self.open.labels(self.model_name, status).set(sum(b.status == status for b in open_batches))


async def asgi_post(app, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
    """One POST through an ASGI app, in-process: (status, headers, body)."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                         *((k.encode(), v.encode()) for k, v in headers.items())],
             "client": ("127.0.0.1", 0), "server": ("expresslane-batch", 0)}
    finished = asyncio.Event()
    state = {"status": 500, "headers": {}, "sent": False}
    chunks: list[bytes] = []

    async def receive() -> dict:
        if not state["sent"]:
            state["sent"] = True
            return {"type": "http.request", "body": body, "more_body": False}
        await finished.wait()  # the app watches for a disconnect: there is none until it answered
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.start":
            state["status"] = message["status"]
            state["headers"] = {k.decode().lower(): v.decode() for k, v in message.get("headers", [])}
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                finished.set()

    try:
        await app(scope, receive, send)
    finally:
        finished.set()
    return state["status"], state["headers"], b"".join(chunks)


class AppExecutor:
    """Runs a batch request through the app in-process, in the batch lane."""

    def __init__(self, app, secret: str):
        self.app = app
        self.headers = {WORKER_HEADER: secret}

    async def __call__(self, item: Item) -> Outcome:
        if item.body.get("stream"):
            return Outcome(ItemResult(item.custom_id, item.index, 400, errors.bad_request(
                "'stream' is not supported in a batch", "stream").body()))
        status, headers, raw = await asgi_post(self.app, item.url, json.dumps({**item.body, "lane": "batch"}).encode(),
                                               self.headers)
        try:
            body = json.loads(raw)
        except ValueError:
            body = {"error": {"message": raw.decode(errors="replace")[:500], "type": "internal_error", "param": None,
                              "code": None}}
        code = (body.get("error") or {}).get("code") if isinstance(body, dict) else None
        if status in _RETRY_STATUS or code == "engine_dead":
            try:
                delay = float(headers.get("retry-after", 1))
            except ValueError:
                delay = 1.0
            return Outcome(retry_after=max(delay, 0.1))
        rid = body.get("id") if isinstance(body, dict) else None
        return Outcome(ItemResult(item.custom_id, item.index, status, body, request_id=rid))


class BatchService:
    def __init__(self, store_url: str, *, concurrency: int, lease: float, poll: float,
                 registry: CollectorRegistry | None = None, model_name: str = ""):
        self.store: BatchStore = open_store(store_url)
        self.concurrency, self.lease, self.poll = concurrency, lease, poll
        self.secret = secrets.token_hex(16)
        self.metrics = BatchMetrics(registry, model_name) if registry is not None else None
        self.worker: BatchWorker | None = None
        self._task: asyncio.Task | None = None
        self._executor: AppExecutor | None = None

    def is_worker(self, request: Request) -> bool:
        """A request from this process's own batch worker (it skips API keys and rate limits)."""
        return secrets.compare_digest(request.headers.get(WORKER_HEADER, ""), self.secret)

    def start(self, app, on_result: Callable[[Item, ItemResult], None] | None = None) -> BatchWorker:
        self._executor = AppExecutor(app, self.secret)
        m = self.metrics

        def answered(item: Item, result: ItemResult) -> None:
            if m is not None:
                m.answered(item, result)
            if on_result is not None:
                on_result(item, result)

        self.worker = BatchWorker(self.store, self._executor, concurrency=self.concurrency, lease=self.lease,
                                  poll=self.poll, on_result=answered,
                                  on_sweep=None if m is None else m.progress)
        self._task = asyncio.create_task(self.worker.run())
        return self.worker

    async def stop(self) -> None:
        """Give unanswered requests back to the queue (another server, or the next start, takes them)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        await asyncio.to_thread(self.store.close)

    async def _call(self, fn, *args):
        try:
            return await asyncio.to_thread(fn, *args)
        except StoreError as e:
            raise _store_error(e) from None

    def router(self, dependencies: list, runner: Callable[[], str | None] = lambda: None) -> APIRouter:
        """`runner`: this server's engine runner (generate, pooling; None before it is known): a batch
        for an endpoint it does not serve is refused when created."""
        r = APIRouter(dependencies=dependencies)
        store = self.store

        @r.post("/v1/files")
        async def upload(request: Request) -> dict:
            if not request.headers.get("content-type", "").startswith("multipart/form-data"):
                raise errors.bad_request("upload the file as multipart/form-data with fields 'file' and 'purpose'",
                                         "file")
            async with request.form(max_files=1) as form:
                f, purpose = form.get("file"), form.get("purpose")
                if f is None or isinstance(f, str):
                    raise errors.bad_request("'file' is required (a multipart file field)", "file",
                                             "missing_required_parameter")
                if not isinstance(purpose, str):
                    raise errors.bad_request("'purpose' is required", "purpose", "missing_required_parameter")
                content = await f.read()
                name = f.filename or "upload.jsonl"
            try:
                check_upload(content, purpose)
            except StoreError as e:
                raise _store_error(e) from None
            rec = FileRecord(new_id("file-"), len(content), int(time.time()), name, purpose)
            await self._call(store.put_file, rec, content)
            return rec.to_openai()

        @r.get("/v1/files")
        async def list_files(purpose: str | None = None, after: str | None = None, limit: str | None = None) -> dict:
            n = _limit(limit if limit is not None else "100")
            files = await self._call(store.list_files, purpose, after, n + 1)
            return {"object": "list", "data": [f.to_openai() for f in files[:n]], "has_more": len(files) > n,
                    "first_id": files[0].id if files else None, "last_id": files[:n][-1].id if files else None}

        async def get_file(file_id: str) -> FileRecord:
            f = await self._call(store.get_file, file_id)
            if f is None:
                raise _not_found("file", file_id, "file_id")
            return f

        @r.get("/v1/files/{file_id}")
        async def retrieve_file(file_id: str) -> dict:
            return (await get_file(file_id)).to_openai()

        @r.get("/v1/files/{file_id}/content")
        async def file_content(file_id: str) -> Response:
            content = await self._call(store.file_content, file_id)
            if content is None:
                raise _not_found("file", file_id, "file_id")
            return Response(content, media_type="application/octet-stream")

        @r.delete("/v1/files/{file_id}")
        async def delete_file(file_id: str) -> dict:
            if not await self._call(store.delete_file, file_id):
                raise _not_found("file", file_id, "file_id")
            return {"id": file_id, "object": "file", "deleted": True}

        @r.post("/v1/batches")
        async def create_batch(request: Request) -> dict:
            req = parse(BatchCreate, await request.body())
            need, have = "pooling" if req.endpoint in POOLING_ENDPOINTS else "generate", runner()
            if req.endpoint in ENDPOINTS and have is not None and have != need:
                raise errors.bad_request(f"endpoint {req.endpoint} needs a server started with --runner {need}; this "
                                         f"one runs {have}", "endpoint")
            b = await self._call(store.create_batch, req.input_file_id, req.endpoint, req.completion_window,
                                 req.metadata, int(time.time()))
            return b.to_openai()

        @r.get("/v1/batches")
        async def list_batches(after: str | None = None, limit: str | None = None) -> dict:
            n = _limit(limit)
            found = await self._call(store.list_batches, after, n + 1)
            page = found[:n]
            return {"object": "list", "data": [b.to_openai() for b in page], "has_more": len(found) > n,
                    "first_id": page[0].id if page else None, "last_id": page[-1].id if page else None}

        @r.get("/v1/batches/{batch_id}")
        async def retrieve_batch(batch_id: str) -> dict:
            b = await self._call(store.get_batch, batch_id)
            if b is None:
                raise _not_found("batch", batch_id, "batch_id")
            return b.to_openai()

        @r.post("/v1/batches/{batch_id}/cancel")
        async def cancel_batch(batch_id: str) -> dict:
            return (await self._call(store.cancel, batch_id, int(time.time()))).to_openai()

        return r



def batch_service(cfg: BatchApiConfig, registry: CollectorRegistry, model_name: str) -> BatchService | None:
    """The Batch API of ``expresslane serve``; None with ``--batch-store none``, or when the default store
    cannot be opened (a read-only home: the server runs without it and says so)."""
    if cfg.batch_store == "none":
        return None
    url = cfg.batch_store or default_store_url(model_name)
    try:
        return BatchService(url, concurrency=cfg.batch_concurrency, lease=cfg.batch_lease_seconds,
                            poll=min(1.0, cfg.batch_lease_seconds / 3), registry=registry, model_name=model_name)
    except Exception as e:  # sqlite3.Error, OSError, redis's ConnectionError, ...
        if cfg.batch_store is None:
            log.warning("the Batch API is off: its default store %s cannot be opened (%s); pass --batch-store",
                        url, e)
            return None
        raise ValueError(f"--batch-store {url!r} cannot be opened: {e}") from None
