"""Does one hostile request stall everyone else? (issue #19 item 2; a measurement, not a test)

Starts `expresslane serve` (built-in tiny model), opens two long streams and a /health
prober (every 20 ms), then sends one hostile request and reports, for the time it is in
flight: the slowest /health answer, the largest gap between two chunks of the other
streams, the hostile request's own status and time, and the API process's RSS before,
at its peak and 2 s after. Kinds: `prompt10mb` (a 10 MB prompt), `stops300k` (300,000
stop strings), `n128lp20` (n=128 with logprobs=20), `ids256x2047` (the largest valid
token-id batch, 256 prompts of 2,047 ids, 3 MB of JSON, naming another model: a 404 right
after the body is decoded and validated, so the window is the parse alone), `ids256x2047run` (the same
batch, served: 524k prompt tokens through admission, the scheduler and the engine). `--repeat N` sends it N times
and reports the RSS 2 s after each.

    python benchmarks/hostile_requests.py                       # every kind, default limits
    python benchmarks/hostile_requests.py --kind n128lp20 --repeat 5
    python benchmarks/hostile_requests.py --kind stops300k -- --max-stop-strings 1000000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx
from _shared import emit, rss_mb

KINDS = {
    "prompt10mb": {"prompt": "word " * 2_000_000, "max_tokens": 4},
    "stops300k": {"prompt": "a short prompt", "max_tokens": 64, "ignore_eos": True,
                  "stop": [f"stop-{i}-x" for i in range(300_000)]},
    "n128lp20": {"prompt": "a short prompt", "max_tokens": 64, "ignore_eos": True, "n": 128, "logprobs": 20},
    "ids256x2047": {"prompt": [[(i * 7919 + j) % 2000 + 10 for i in range(2047)] for j in range(256)],
                    "max_tokens": 1, "model": "not-this-one"},
    "ids256x2047run": {"prompt": [[(i * 7919 + j) % 2000 + 10 for i in range(2047)] for j in range(256)],
                       "max_tokens": 1},
}


def _quantile(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def measure(url: str, pid: int, kind: str, repeat: int) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=None)) as http:
        await http.post("/v1/completions", json={"prompt": "warm up", "max_tokens": 4})
        rss_before = rss_mb(pid)
        window: list[float] = []  # [start, end] of the hostile request
        gaps: list[float] = []
        health: list[float] = []
        peak = [rss_before]
        stop = asyncio.Event()

        async def stream(i: int) -> None:
            last = None
            while not stop.is_set():
                async with http.stream("POST", "/v1/completions", json={
                        "prompt": f"background stream {i}", "max_tokens": 1500, "ignore_eos": True,
                        "stream": True}) as r:
                    async for line in r.aiter_lines():
                        now = time.monotonic()
                        if line.startswith("data: ") and last is not None and len(window) == 1:
                            gaps.append(now - last)
                        last = now
                        if stop.is_set():
                            return

        async def probe() -> None:
            while not stop.is_set():
                t0 = time.monotonic()
                await http.get("/health")
                if len(window) == 1:
                    health.append(time.monotonic() - t0)
                    peak[0] = max(peak[0], rss_mb(pid))
                await asyncio.sleep(0.02)

        tasks = [asyncio.create_task(stream(i)) for i in range(2)] + [asyncio.create_task(probe())]
        await asyncio.sleep(1.0)  # the streams are decoding
        body = json.dumps(KINDS[kind]).encode()
        window.append(time.monotonic())
        r = await http.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
        window.append(time.monotonic())
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.sleep(2.0)
        rss_after = [round(rss_mb(pid), 1)]
        for _ in range(repeat - 1):
            await http.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
            await asyncio.sleep(2.0)
            rss_after.append(round(rss_mb(pid), 1))
        err = r.json().get("error") if r.headers.get("content-type", "").startswith("application/json") else None
        return {"kind": kind, "status": r.status_code, "error": err and err["message"][:120],
                "body_mb": round(len(body) / 1e6, 1), "in_flight_s": round(window[1] - window[0], 3),
                "health_max_ms": round(1e3 * max(health, default=0.0), 1), "health_samples": len(health),
                "stream_gap_max_ms": round(1e3 * max(gaps, default=0.0), 1), "stream_gaps": len(gaps),
                "stream_gap_p50_ms": round(1e3 * _quantile(gaps, 0.5), 1),
                "stream_gap_p90_ms": round(1e3 * _quantile(gaps, 0.9), 1),
                "rss_before_mb": round(rss_before, 1), "rss_peak_mb": round(peak[0], 1),
                "rss_after_mb": rss_after[0] if repeat == 1 else rss_after}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kind", choices=sorted(KINDS), action="append", help="default: every kind")
    p.add_argument("--out", default=None, help="append the JSON lines to this file")
    p.add_argument("--repeat", type=int, default=1, help="send the hostile request this many times (RSS after each)")
    p.add_argument("serve_args", nargs="*", help="extra `expresslane serve` flags (after --)")
    args = p.parse_args()
    for kind in args.kind or list(KINDS):
        port = free_port()
        log = tempfile.NamedTemporaryFile(prefix="hostile-", suffix=".log", delete=False)
        proc = subprocess.Popen([sys.executable, "-m", "expresslane.cli.main", "serve", "--port", str(port),
                                 "--max-model-len", "2048", *args.serve_args], stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 300
            while True:
                try:
                    if httpx.get(url + "/health", timeout=1).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"server did not start; log: {log.name}")
                time.sleep(0.2)
            row = asyncio.run(measure(url, proc.pid, kind, args.repeat))
            row["serve_args"] = " ".join(args.serve_args)
            emit(args.out, bench="hostile_request", **row)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            os.unlink(log.name)


if __name__ == "__main__":
    main()
