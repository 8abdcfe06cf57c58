"""Which store a URL names, and the default one per served model."""

from __future__ import annotations

import os
import re
from pathlib import Path

from expresslane.batch_api.store import BatchStore


def default_store_url(model_name: str) -> str:
    """One SQLite file per served model name, in expresslane's cache directory."""
    cache = Path(os.environ.get("EXPRESSLANE_CACHE") or Path.home() / ".cache" / "expresslane")
    return f"sqlite:{cache / ('batches-' + re.sub(r'[^A-Za-z0-9._-]+', '_', model_name) + '.db')}"


def open_store(url: str) -> BatchStore:
    """``sqlite:PATH`` (or a plain path) or ``redis://HOST:PORT/DB[?prefix=NAME]``."""
    if url.startswith(("redis://", "rediss://", "unix://")):
        from expresslane.batch_api.redis_store import RedisStore
        return RedisStore(url)
    from expresslane.batch_api.sqlite_store import SQLiteStore
    return SQLiteStore(url.removeprefix("sqlite:"))
