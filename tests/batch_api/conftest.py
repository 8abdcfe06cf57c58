"""Stores of each kind: SQLite in a temporary file, and Redis on a real redis-server."""

from __future__ import annotations

import pytest

from expresslane.batch_api.registry import open_store


@pytest.fixture(params=["sqlite", "redis"])
def store_url(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite:{tmp_path / 'batches.db'}"
    return request.getfixturevalue("redis_server").store_url()


@pytest.fixture
def store(store_url):
    s = open_store(store_url)
    try:
        yield s
    finally:
        s.close()
