"""Real `expresslane serve` processes on free 127.0.0.1 ports, always killed at teardown.

`server` (one per session, shared by the non-destructive modules) runs the built-in
tiny model with an API key; tests that stop or break a server start their own.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from expresslane import LLM

API_KEY = "test-key"
MAX_MODEL_LEN = 256
ENGINE_ARGS = ("--num-kv-blocks", "512", "--max-num-seqs", "64", "--max-model-len", str(MAX_MODEL_LEN))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, *args: str, api_key: str | None = API_KEY, port: int | None = None):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log = tempfile.NamedTemporaryFile(prefix="expresslane-serve-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "expresslane.cli.main", "--log-level", "INFO", "serve", "--port", str(self.port),
               *ENGINE_ARGS, *(("--api-key", api_key) if api_key else ()), *args]
        # Own session: teardown can kill the server and its engine process as one group.
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def wait_ready(self, timeout: float = 120.0) -> "Server":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server not ready after {timeout}s:\n{self.log_tail()}")

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(Path(self.log.name).read_text(errors="replace").splitlines()[-n:])

    def engine_pid(self) -> int:
        """The engine process: the server's child started by multiprocessing's spawn."""
        for pid in _children(self.proc.pid):
            if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return pid
        raise RuntimeError("no engine process found")

    def metrics(self) -> dict[str, float]:
        """Sample lines of /metrics, as 'name{labels}' -> value."""
        text = httpx.get(self.url + "/metrics", timeout=5.0).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                out[key] = float(value)
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the engine too, whatever state it is in
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.log.close()
        os.unlink(self.log.name)


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def metric(m: dict[str, float], name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    total = 0.0
    for key, value in m.items():
        base, _, rest = key.partition("{")
        if base == name and all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total += value
    return total


@pytest.fixture(scope="session")
def server():
    s = Server()
    try:
        yield s.wait_ready()
    finally:
        s.stop()


@pytest.fixture(scope="session")
def llm():
    """The offline engine: the greedy reference for the server's outputs."""
    return LLM(None, num_kv_blocks=512, max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="session")
def openai_client(server):
    return OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
