"""Router tests' processes: fake replicas (fake_replica.py) and real `expresslane router` /
`expresslane serve` processes on free ports, all killed at teardown."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from server.conftest import free_port

HERE = Path(__file__).parent


class Proc:
    def __init__(self, cmd: list[str], url: str, ready_path: str):
        self.url, self.ready_path = url, ready_path
        self.log = tempfile.NamedTemporaryFile(prefix="expresslane-router-test-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout: float = 120.0) -> "Proc":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + self.ready_path, timeout=1.0).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"not ready after {timeout}s:\n{self.log_tail()}")

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(Path(self.log.name).read_text(errors="replace").splitlines()[-n:])

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        self.kill()
        self.log.close()
        Path(self.log.name).unlink(missing_ok=True)


def fake_replica(name: str, waiting: int = 0) -> Proc:
    port = free_port()
    return Proc([sys.executable, str(HERE / "fake_replica.py"), str(port), name, str(waiting)],
                f"http://127.0.0.1:{port}", "/load")


def router(backends: list[str], health_interval: float = 0.5) -> Proc:
    port = free_port()
    cmd = [sys.executable, "-m", "expresslane.cli.main", "--log-level", "INFO", "router", "--port", str(port),
           "--health-interval", str(health_interval)] + [a for url in backends for a in ("--backend", url)]
    return Proc(cmd, f"http://127.0.0.1:{port}", "/health")
