"""Prometheus's binaries for the deploy tests: CI installs them (.ci/run); a machine without
them fails these tests, unless EXPRESSLANE_SKIP_PROMETHEUS=1 says to skip them."""

from __future__ import annotations

import os
import shutil

import pytest


def prometheus_binary(name: str) -> str:
    path = shutil.which(name)
    if path is not None:
        return path
    why = f"{name} not found on PATH (Debian: apt-get install prometheus; .ci/run installs it)"
    if os.environ.get("EXPRESSLANE_SKIP_PROMETHEUS") == "1":
        pytest.skip(f"SKIPPED ON PURPOSE (EXPRESSLANE_SKIP_PROMETHEUS=1): {why}")
    pytest.fail(why)
