"""``expresslane serve --data-parallel-size N``: N replicas of the server, each with its own
engine (on GPU: its own ``tensor_parallel_size`` GPUs, through CUDA_VISIBLE_DEVICES), on
private 127.0.0.1 ports, behind the router on the public address. The replicas end with
this process (SIGTERM on the way out; the kernel's parent-death signal if it is killed).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import time

import httpx

from expresslane.config.flags import flag_name
from expresslane.config.server import ListenConfig, RouterConfig, ServerConfig
from expresslane.router.serve import free_port, run_router

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_OWN_FLAGS = tuple(flag_name(ServerConfig, name) for name in ("data_parallel_size", "port", "host"))


def replica_argv(argv: list[str]) -> list[str]:
    """The serve command line without the flags that belong to the front (they take a value)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in _OWN_FLAGS:
            skip = True
        elif not arg.startswith(tuple(f + "=" for f in _OWN_FLAGS)):
            out.append(arg)
    return out


def _die_with_parent() -> None:
    try:
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux: replicas end on SIGTERM from the normal exit path only
        pass


def _gpu_slices(n: int, per_replica: int) -> list[str | None]:
    try:
        import torch
        count = torch.cuda.device_count()
    except ImportError:
        count = 0
    if count == 0:
        return [None] * n
    if n * per_replica > count:
        raise ValueError(f"--data-parallel-size {n} x --tensor-parallel-size {per_replica} needs {n * per_replica} "
                         f"GPUs; {count} visible")
    return [",".join(str(i * per_replica + j) for j in range(per_replica)) for i in range(n)]


def serve_data_parallel(size: int, tp: int, listen: ListenConfig, log_level: str, argv: list[str],
                        start_timeout: float = 600.0) -> int:
    """The replicas, then the router (its own defaults but the address) on ``listen``."""
    if size < 1:
        raise ValueError(f"--data-parallel-size must be >= 1, got {size}")
    base = replica_argv(argv)
    procs, urls = [], []
    try:
        for gpus in _gpu_slices(size, tp):
            p = free_port()
            env = dict(os.environ)
            if gpus is not None:
                env["CUDA_VISIBLE_DEVICES"] = gpus
            procs.append(subprocess.Popen([sys.executable, "-m", "expresslane.cli.main", *base, "--host", "127.0.0.1",
                                           "--port", str(p)], env=env, preexec_fn=_die_with_parent))
            urls.append(f"http://127.0.0.1:{p}")
        _wait_ready(procs, urls, start_timeout)
        log.warning("data parallel: %d replicas ready: %s", size, ", ".join(urls))
        return run_router(RouterConfig(backend=tuple(urls), listen=listen), log_level)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _wait_ready(procs: list[subprocess.Popen], urls: list[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    pending = set(range(len(procs)))
    while pending:
        for i in list(pending):
            if procs[i].poll() is not None:
                raise ValueError(f"data-parallel replica {i} exited with {procs[i].returncode} while starting")
            try:
                if httpx.get(urls[i] + "/health", timeout=1.0).status_code == 200:
                    pending.discard(i)
            except httpx.TransportError:
                pass
        if time.monotonic() > deadline:
            raise ValueError(f"data-parallel replicas {sorted(pending)} not ready after {timeout:g} s")
        time.sleep(0.2)
