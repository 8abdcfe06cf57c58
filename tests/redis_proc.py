"""A real redis-server on a free port, for the batch store's tests (tests/batch_api, tests/server)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
import uuid

import pytest
import redis


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    def __init__(self, workdir):
        exe = shutil.which("redis-server")
        if exe is None:
            pytest.fail("redis-server is not installed (apt-get install -y redis-server; .ci/run does it)")
        self.port = _free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        # No RDB/AOF files: the process's memory is the store. A kill -9 of an expresslane
        # server never touches it; the test drives redis-server's life itself.
        self.proc = subprocess.Popen([exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--dir", str(workdir)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + 30
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start (exit code {self.proc.poll()})") from None
                time.sleep(0.05)
        client.close()

    def store_url(self) -> str:
        """A fresh key prefix: stores of different tests never meet."""
        return f"{self.url}?prefix=t{uuid.uuid4().hex[:8]}"

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()
