"""Signals to the whole process group, as systemd (KillMode=control-group), `tini -g`, `dumb-init`,
`kill -- -PGID` and Ctrl-C send them: the engine process ignores them, the API process drains and
then stops the engine, and the exit code is 0. The engine also ends, with no orphan left, when the
API process is SIGKILLed. (SIGTERM to the API process alone: test_sigterm.py.)"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from .conftest import Server

pytestmark = pytest.mark.reliability

TOKENS = 200


def _state(pid: int) -> str | None:
    """The process's state letter ('Z' for a zombie), or None once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return None


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_to_the_whole_group_drains_and_exits_0(sig):
    server = Server("--shutdown-timeout", "120").wait_ready()  # Server starts it in a session of its own
    try:
        engine = server.engine_pid()
        assert os.getpgid(engine) == server.proc.pid  # the engine is in the group that gets the signal
        tokens, finish = 0, None
        with httpx.stream("POST", server.url + "/v1/completions", headers=server.headers, timeout=120,
                          json={"prompt": "group", "max_tokens": TOKENS, "ignore_eos": True, "stream": True}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                assert "error" not in event, event
                if tokens == 0:  # the request is in flight: signal every process of the server
                    os.killpg(server.proc.pid, sig)
                tokens += 1
                finish = event["choices"][0]["finish_reason"] or finish
        assert (tokens, finish) == (TOKENS, "length")
        assert server.proc.wait(timeout=60) == 0, server.log_tail()
        assert "exited unexpectedly" not in server.log_tail(200)
        assert _state(engine) in (None, "Z")  # stopped by the API process, not left running
    finally:
        server.stop()


def test_the_engine_exits_when_the_api_process_is_killed():
    server = Server().wait_ready()
    try:
        engine = server.engine_pid()
        os.kill(server.proc.pid, signal.SIGKILL)
        server.proc.wait()
        deadline = time.monotonic() + 30  # a hang guard: the engine watches its parent every 0.5 s
        while _state(engine) not in (None, "Z"):
            assert time.monotonic() < deadline, f"the engine process {engine} outlived the API process"
            time.sleep(0.1)
    finally:
        server.stop()
