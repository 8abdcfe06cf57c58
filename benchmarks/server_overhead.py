"""Server overhead: TTFT seen through HTTP minus the engine's own TTFT, for 1-token requests.

Each request is a streamed ``/v1/completions`` with ``max_tokens=1`` and
``return_metrics=true``; the last chunk then carries the engine's monotonic timestamps.
The engine's TTFT is ``first_token_time - engine_arrival_time`` (from the moment the
engine process took the request to its first token); everything else the client waits
for is overhead: HTTP and JSON, validation, tokenization, admission, the ZeroMQ hop
both ways, detokenization and SSE. Client and server share ``time.monotonic()`` on one
host, so the overhead is also split into "in" (client send -> engine took it) and "out"
(first token -> client has the chunk).

Two runs: N sequential requests (overhead alone), then C concurrent closed-loop streams
(overhead under load: the API process's event loop is shared). Starts its own
``expresslane serve`` on a free port unless --base-url is given.

    python benchmarks/server_overhead.py                      # tiny model, CPU
    python benchmarks/server_overhead.py --sequential 200 --concurrency 64 --rounds 4 --output overhead.json
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
import time
import urllib.request

import aiohttp
import numpy as np


async def one_request(session: aiohttp.ClientSession, url: str, model: str, prompt: str) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "return_metrics": True}
    sent = time.monotonic()
    first = None
    metrics = None
    async with session.post(url + "/v1/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {await r.text()}")
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if first is None and chunk["choices"] and chunk["choices"][0]["text"]:
                first = time.monotonic()
            metrics = chunk.get("metrics", metrics)
    if first is None or metrics is None:
        raise RuntimeError("the stream had no text or no metrics")
    engine_ttft = metrics["first_token_time"] - metrics["engine_arrival_time"]
    return {"http_ttft": first - sent, "engine_ttft": engine_ttft, "overhead": first - sent - engine_ttft,
            "in": metrics["engine_arrival_time"] - sent, "out": first - metrics["first_token_time"]}


def summarize(samples: list[dict]) -> dict:
    out = {"requests": len(samples)}
    if not samples:
        return out
    for key in ("http_ttft", "engine_ttft", "overhead", "in", "out"):
        ms = np.array([s[key] for s in samples]) * 1000
        out[key] = {"p50_ms": round(float(np.percentile(ms, 50)), 3), "p99_ms": round(float(np.percentile(ms, 99)), 3),
                    "mean_ms": round(float(ms.mean()), 3)}
    return out


async def run(url: str, model: str, sequential: int, concurrency: int, rounds: int, warmup: int) -> dict:
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:
        for i in range(warmup):
            await one_request(session, url, model, f"warm-up {i}")
        seq = [await one_request(session, url, model, f"Sequential request {i}") for i in range(sequential)]

        async def worker(w: int) -> list[dict]:
            return [await one_request(session, url, model, f"Worker {w} request {k}") for k in range(rounds)]

        t0 = time.monotonic()
        conc = [s for batch in await asyncio.gather(*(worker(w) for w in range(concurrency))) for s in batch]
        elapsed = time.monotonic() - t0
    return {"sequential": summarize(seq),
            f"concurrent_{concurrency}": {**summarize(conc), "requests_per_s": round(len(conc) / elapsed, 1)}}


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "expresslane.cli.main", "serve", *([args.model] if args.model else []),
           "--port", str(port), "--served-model-name", args.served_model_name,
           "--max-num-seqs", str(max(args.concurrency, 1)), *args.server_args]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if urllib.request.urlopen(url + "/health", timeout=1).status == 200:
                return proc, url
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise TimeoutError("the server did not become healthy")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default=None, help="an already running expresslane server (same host)")
    p.add_argument("--model", default=None, help="model directory for the server this script starts")
    p.add_argument("--served-model-name", default="tiny")
    p.add_argument("--sequential", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--rounds", type=int, default=4, help="requests per concurrent stream, one after another")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--output", default=None, help="also write the JSON here")
    p.add_argument("server_args", nargs=argparse.REMAINDER, help="after --: extra `expresslane serve` flags")
    args = p.parse_args()
    args.server_args = [a for a in args.server_args if a != "--"]
    proc = None
    url = args.base_url
    if url is None:
        proc, url = start_server(args)
    try:
        result = asyncio.run(run(url.rstrip("/"), args.served_model_name, args.sequential, args.concurrency,
                                 args.rounds, args.warmup))
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
    result["command"] = " ".join(["python", *sys.argv])
    text = json.dumps(result, indent=2)
    print(text)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
