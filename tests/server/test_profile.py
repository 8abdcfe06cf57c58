"""Profiling on demand: /start_profile and /stop_profile write a trace of the engine process
that loads; without --profile-dir they are refused with a message naming the flag."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from .conftest import Server


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    directory = tmp_path_factory.mktemp("profiles")
    s = Server("--profile-dir", str(directory))
    try:
        yield s.wait_ready(), directory
    finally:
        s.stop()


def test_start_then_stop_writes_a_trace_of_the_engine_that_loads(profiled):
    s, directory = profiled
    post = lambda path: httpx.post(s.url + path, headers=s.headers, timeout=120)  # noqa: E731
    r = post("/start_profile")
    assert r.status_code == 200 and r.json()["profile_dir"] == str(directory)
    again = post("/start_profile")
    assert again.status_code == 400 and "already running" in again.json()["error"]["message"]
    done = httpx.post(s.url + "/v1/completions", json={"prompt": "profile me", "max_tokens": 4}, headers=s.headers,
                      timeout=60)
    assert done.status_code == 200
    r = post("/stop_profile")
    assert r.status_code == 200, r.text
    trace = Path(r.json()["trace"])
    assert trace.parent == directory and trace.exists()
    events = json.loads(trace.read_text())["traceEvents"]
    pids = {e["pid"] for e in events if e.get("ph") == "X" and isinstance(e["pid"], int)}
    assert pids == {s.engine_pid()}  # the engine process, not the API process
    names = {e["name"] for e in events}
    assert any("aten::" in n for n in names)  # the model's ops ran while it recorded
    stray = post("/stop_profile")
    assert stray.status_code == 400 and "no profile is running" in stray.json()["error"]["message"]
    assert post("/start_profile").status_code == 200 and post("/stop_profile").status_code == 200  # again
    assert len(list(directory.glob("*.json"))) == 2
    assert httpx.get(s.url + "/health").status_code == 200


def test_profile_routes_need_the_key(profiled):
    s, _ = profiled
    assert httpx.post(s.url + "/start_profile").status_code == 401


def test_without_the_flag_profiling_is_refused(server):
    for path in ("/start_profile", "/stop_profile"):
        r = httpx.post(server.url + path, headers=server.headers)
        assert r.status_code == 404
        err = r.json()["error"]
        assert err["code"] == "profiling_disabled" and "--profile-dir" in err["message"]


def test_a_profile_dir_that_cannot_be_made_is_refused_at_start(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    r = subprocess.run([sys.executable, "-m", "expresslane.cli.main", "serve", "--profile-dir", str(blocker / "x")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "--profile-dir" in r.stderr
