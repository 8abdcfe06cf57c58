"""The GPU gauges move with load: `expresslane serve` on the GPU, /metrics read while idle,
then while concurrent clients stream long completions (issue #14's "recorded once").

    python benchmarks/gpu_metrics.py --model MODEL_DIR [--clients 32] [--duration 30] [--out results.jsonl]

Prints each sample (utilisation, memory used, power) and one JSON line: idle vs load means.
Standard library only on the client side (the GPU machine has no httpx).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import urllib.request

from _shared import emit, start_server, stop_server

GAUGES = ("gpu_utilization_perc", "gpu_memory_used_bytes", "gpu_power_watts")


def gpu_gauges(url: str) -> dict[str, float]:
    """The gpu="0" sample of each GPU gauge."""
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        for g in GAUGES:
            if line.startswith(f"expresslane:{g}{{") and 'gpu="0"' in line:
                out[g] = float(line.rsplit(" ", 1)[1])
    return out


def sample(url: str, seconds: float, phase: str) -> list[dict[str, float]]:
    rows = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(1.0)  # NVML is sampled once a second by the server
        g = gpu_gauges(url)
        rows.append(g)
        print(f"{phase:5s} util {g.get('gpu_utilization_perc', float('nan')):6.0%}  memory "
              f"{g.get('gpu_memory_used_bytes', float('nan')) / 2**30:7.2f} GiB  power "
              f"{g.get('gpu_power_watts', float('nan')):6.1f} W", flush=True)
    return rows


def client(url: str, stop: threading.Event, max_tokens: int, done: list[int]) -> None:
    body = json.dumps({"prompt": "Tell me a long story about the sea. " * 8, "max_tokens": max_tokens,
                       "ignore_eos": True}).encode()
    while not stop.is_set():
        req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
        urllib.request.urlopen(req, timeout=600).read()
        done.append(1)


def mean(rows: list[dict[str, float]], key: str) -> float | None:
    values = [r[key] for r in rows if key in r]
    return statistics.fmean(values) if values else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--idle", type=float, default=5.0, help="seconds sampled before the load")
    p.add_argument("--duration", type=float, default=30.0, help="seconds sampled under load")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    log = tempfile.NamedTemporaryFile(prefix="gpu-metrics-serve-", suffix=".log", delete=False)
    try:
        server, url = start_server([args.model, "--dtype", args.dtype], log.name, timeout=900)
    except (RuntimeError, TimeoutError):
        print(open(log.name).read()[-3000:], file=sys.stderr)
        return 1
    stop = threading.Event()
    try:
        idle = sample(url, args.idle, "idle")
        done: list[int] = []
        threads = [threading.Thread(target=client, args=(url, stop, args.max_tokens, done), daemon=True)
                   for _ in range(args.clients)]
        for t in threads:
            t.start()
        time.sleep(3)  # past the first prefills: decode is what a loaded server mostly runs
        load = sample(url, args.duration, "load")
        row = {"bench": "gpu_metrics", "model": os.path.basename(args.model.rstrip("/")), "clients": args.clients,
               "requests_done": len(done)}
        for key in GAUGES:
            row[f"idle_{key}"], row[f"load_{key}"] = mean(idle, key), mean(load, key)
        emit(args.out, **row)
        return 0 if row["load_gpu_utilization_perc"] is not None else 1  # no GPU metrics: a failure here
    finally:
        stop.set()
        stop_server(server, 60.0)
        log.close()
        os.unlink(log.name)


if __name__ == "__main__":
    sys.exit(main())
