"""The reliability suite (issue #19, item 7): real `expresslane serve` processes under hostile clients.

It reuses the server tests' harness (tests/server/conftest.py: `Server`, the shared `server`
fixture on the built-in tiny model, `/metrics` parsing) rather than a copy of it.
Run it with ``python -m pytest -m reliability``; a plain run (CI) leaves out its ``slow`` part (pyproject addopts).
"""

from __future__ import annotations

import json

import httpx
import pytest

from server.conftest import Server, metric, server  # noqa: F401  (`server`: the shared fixture, reused here)


@pytest.fixture(scope="session", autouse=True)
def _own_batch_store(tmp_path_factory):
    """The servers started here keep their Batch API store (the fuzzer uploads files) in a temporary
    directory, not in the user's ~/.cache/expresslane."""
    mp = pytest.MonkeyPatch()
    mp.setenv("EXPRESSLANE_CACHE", str(tmp_path_factory.mktemp("cache")))
    yield
    mp.undo()


def sse_events(lines) -> list:
    """The `data:` payloads of an event stream: parsed JSON, or the string '[DONE]'."""
    return [line[6:] if line == "data: [DONE]" else json.loads(line[6:]) for line in lines if line.startswith("data: ")]


def serves_a_normal_request(s: Server) -> None:
    """The server is healthy and completes an ordinary request end to end."""
    health = httpx.get(s.url + "/health", timeout=10)
    assert health.status_code == 200, health.text
    r = httpx.post(s.url + "/v1/completions", headers=s.headers, timeout=60,
                   json={"prompt": "still serving", "max_tokens": 4, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4 and r.json()["choices"][0]["finish_reason"] == "length"
