"""What the GPU benchmark scripts share beyond the bench package (whose floors, prompts,
stats and client they use): result lines, profiler sums, a server started and stopped.
(Imported as a sibling module: the scripts run as `python benchmarks/NAME.py`.)"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request


def rss_mb(pid: int) -> float:
    """A process's resident set, MB (Linux)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def emit(out: str | None, **row) -> dict:
    """Print one result as a JSON line, and append it to `out` when given; the row back."""
    line = json.dumps(row)
    print(line, flush=True)
    if out:
        with open(out, "a") as f:
            f.write(line + "\n")
    return row


def copy_bandwidth(gigabytes: float = 2.0, reps: int = 10) -> float:
    """This GPU's device-to-device copy bandwidth, bytes read and written per second (the
    floors' measure: DESIGN §8 took 4.27 TB/s on one H200; an H100 has its own)."""
    import torch

    src = torch.empty(int(gigabytes * 1e9) // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / reps
    del src, dst
    torch.cuda.empty_cache()
    return 2 * gigabytes * 1e9 / seconds


def prompts_of(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """n random prompts of `length` tokens. The seed is drawn with the length, so prompts of
    different lengths never share a prefix (the prefix cache would serve it, and a TTFT would
    time fewer tokens than its length)."""
    import random

    from expresslane.bench.inprocess import random_prompts

    return random_prompts(random.Random(f"{seed}-{length}"), vocab, [length] * n)


def parse_flag(text: str) -> tuple[str, object]:
    """`--flag KEY=VALUE`: an engine argument (an LLM keyword), the value an int or float if it reads as one."""
    key, _, value = text.partition("=")
    for cast in (int, float):
        try:
            return key, cast(value)
        except ValueError:
            pass
    return key, value


def graph_us(calls, reps: int = 10) -> float:
    """Microseconds per call: a CUDA graph of `calls` in order, replayed `reps` times."""
    import torch

    for c in calls:  # compile, settle the allocator
        c()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / reps / len(calls)


def launch_steps(eng, steps: int) -> list[int]:
    """Step the engine until `steps` more steps are launched (a call may launch none:
    `EngineCore.held`); the sequences of each launched step."""
    core, seqs = eng.core, []
    while len(seqs) < steps:
        calls = core._calls
        eng.step()
        if core._calls > calls:
            seqs.append(core.stats().batch_size)
    return seqs


def kernel_intervals(prof) -> list[tuple[float, float, str]]:
    """(start µs, end µs, name) of every GPU activity in a torch.profiler trace, in order
    (user annotations, which the profiler also puts on the GPU timeline, left out)."""
    import torch

    return sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                  if e.device_type == torch.autograd.DeviceType.CUDA
                  and not getattr(e, "is_user_annotation", False))


def busy_us(intervals) -> float:
    """Time covered by the union of the intervals (one stream: overlaps are copies)."""
    busy, end = 0.0, float("-inf")
    for s, e, _ in intervals:
        if e > end:
            busy += e - max(s, end)
            end = e
    return busy


def start_server(serve_args: list[str], log_path: str, timeout: float = 600.0) -> tuple[subprocess.Popen, str]:
    """``expresslane serve SERVE_ARGS`` on a free port, in its own process group, logging to
    ``log_path``; returns once ``/health`` says ok (or raises, naming the log)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "expresslane.cli.main", "serve", *serve_args, "--port", str(port)]
    print("$", " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd, stdout=open(log_path, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; see {log_path}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as resp:
                if resp.status == 200:
                    return proc, url
        except OSError:
            pass
        time.sleep(0.5)
    stop_server(proc, 5.0)
    raise TimeoutError(f"server not ready after {timeout:.0f} s; see {log_path}")


def stop_server(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    """SIGTERM (the server drains), then the whole process group is killed if it lingers."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
