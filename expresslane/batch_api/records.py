"""Files, batches, work items and results, in OpenAI's shapes, and the JSONL formats.

Input line:  ``{"custom_id": "r1", "method": "POST", "url": "/v1/completions", "body": {...}}``
Output line: ``{"id": "batch_req_..", "custom_id": "r1", "response": {"status_code": 200,
"request_id": "..", "body": {...}}, "error": null}`` (a failed request goes to the error file,
with its error response, or with ``response: null`` and an ``error`` when it never ran).
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from dataclasses import dataclass, field

ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings")
POOLING_ENDPOINTS = ("/v1/embeddings",)  # served by a --runner pooling server (the others: generation)
COMPLETION_WINDOWS = {"24h": 24 * 3600}
MAX_REQUESTS = 50_000  # OpenAI's limits on one batch
MAX_FILE_BYTES = 200 * 2**20
MAX_LISTED_ERRORS = 100
FILE_PURPOSES = ("batch", "batch_output")
# Statuses in which no request of the batch will run again.
TERMINAL = ("failed", "completed", "expired", "cancelled")


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


class _Record:
    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes):
        return cls(**json.loads(text))


@dataclass(slots=True)
class FileRecord(_Record):
    id: str
    bytes: int
    created_at: int
    filename: str
    purpose: str

    def to_openai(self) -> dict:
        return {"id": self.id, "object": "file", "bytes": self.bytes, "created_at": self.created_at,
                "filename": self.filename, "purpose": self.purpose, "status": "processed", "expires_at": None,
                "status_details": None}


@dataclass(slots=True)
class BatchRecord(_Record):
    id: str
    endpoint: str
    input_file_id: str
    completion_window: str
    created_at: int
    expires_at: int
    status: str
    total: int = 0
    completed: int = 0
    failed: int = 0
    model: str | None = None
    metadata: dict | None = None
    errors: list[dict] | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    usage: dict | None = None
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None

    def to_openai(self) -> dict:
        d = dataclasses.asdict(self)
        for k in ("total", "completed", "failed"):
            del d[k]
        d["object"] = "batch"
        d["request_counts"] = {"total": self.total, "completed": self.completed, "failed": self.failed}
        d["errors"] = None if self.errors is None else {"object": "list", "data": self.errors}
        return d


@dataclass(slots=True)
class Item:
    """One request of a batch: its place in the input file, its id and what to run."""

    batch_id: str
    index: int  # 0-based line of the request in the input file
    custom_id: str
    url: str
    body: dict
    token: str = ""  # the store's handle on a claim (Redis: the stream entry id)

    def to_json(self) -> str:
        return json.dumps({"custom_id": self.custom_id, "url": self.url, "body": self.body}, separators=(",", ":"))

    @classmethod
    def from_json(cls, batch_id: str, index: int, text: str | bytes, token: str = "") -> "Item":
        d = json.loads(text)
        return cls(batch_id, index, d["custom_id"], d["url"], d["body"], token)


@dataclass(slots=True)
class ItemResult:
    """What one request produced: an HTTP response, or an error if it never ran."""

    custom_id: str
    index: int
    status_code: int | None
    body: dict | None = None
    error: dict | None = None  # {"code", "message"} when there is no response
    id: str = field(default_factory=lambda: new_id("batch_req_"))
    request_id: str | None = None

    @property
    def ok(self) -> bool:
        return self.status_code == 200

    def line(self) -> dict:
        response = None if self.status_code is None else {
            "status_code": self.status_code, "request_id": self.request_id or self.id, "body": self.body}
        return {"id": self.id, "custom_id": self.custom_id, "response": response, "error": self.error}

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> "ItemResult":
        return cls(**json.loads(text))


def jsonl(rows: list[dict]) -> bytes:
    return b"".join(json.dumps(r, separators=(",", ":")).encode() + b"\n" for r in rows)


def _error(line: int, code: str, message: str, param: str | None = None) -> dict:
    return {"code": code, "line": line, "message": message, "param": param}


def parse_input(content: bytes, endpoint: str) -> tuple[list[Item], list[dict]]:
    """An input file -> its requests, or OpenAI ``BatchError`` dicts (1-based lines) when invalid.

    Blank lines are skipped; every other line must be a request to ``endpoint`` with a
    ``custom_id`` unique in the file. Items carry an empty batch id until the batch exists.
    """
    items: list[Item] = []
    errors: list[dict] = []
    seen: set[str] = set()
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError as e:
        return [], [_error(1, "invalid_file", f"the file is not UTF-8 text: {e}")]
    for n, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        try:
            d = json.loads(raw)
        except json.JSONDecodeError as e:
            errors.append(_error(n, "invalid_json_line", f"line {n} is not valid JSON: {e}"))
            continue
        if not isinstance(d, dict):
            errors.append(_error(n, "invalid_json_line", f"line {n} is not a JSON object"))
            continue
        cid, url, body = d.get("custom_id"), d.get("url"), d.get("body")
        if not isinstance(cid, str) or not cid:
            errors.append(_error(n, "missing_required_parameter", f"line {n}: 'custom_id' must be a non-empty string",
                                 "custom_id"))
        elif cid in seen:
            errors.append(_error(n, "duplicate_custom_id", f"line {n}: custom_id {cid!r} appears more than once",
                                 "custom_id"))
        elif d.get("method", "POST") != "POST":
            errors.append(_error(n, "invalid_value", f"line {n}: 'method' must be POST", "method"))
        elif url != endpoint:
            errors.append(_error(n, "mismatched_endpoint",
                                 f"line {n}: 'url' is {url!r}, but the batch's endpoint is {endpoint!r}", "url"))
        elif not isinstance(body, dict):
            errors.append(_error(n, "missing_required_parameter", f"line {n}: 'body' must be a JSON object", "body"))
        else:
            seen.add(cid)
            items.append(Item("", len(items), cid, url, body))
    if not items and not errors:
        errors.append(_error(1, "empty_file", "the input file holds no requests"))
    if len(items) > MAX_REQUESTS:
        errors.append(_error(1, "too_many_requests", f"a batch holds at most {MAX_REQUESTS} requests, "
                                                     f"the file has {len(items)}"))
    return items, errors[:MAX_LISTED_ERRORS]


def output_files(results: list[ItemResult]) -> tuple[bytes, bytes, dict]:
    """A finished batch's results -> (output file, error file, usage), in input order."""
    results = sorted(results, key=lambda r: r.index)
    ok = [r.line() for r in results if r.ok]
    bad = [r.line() for r in results if not r.ok]
    inp = out = cached = 0
    for r in results:
        u = (r.body or {}).get("usage") if r.ok else None
        if u:
            inp += u.get("prompt_tokens", 0)
            out += u.get("completion_tokens", 0)
            cached += (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    usage = {"input_tokens": inp, "input_tokens_details": {"cached_tokens": cached}, "output_tokens": out,
             "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": inp + out}
    return jsonl(ok), jsonl(bad), usage
