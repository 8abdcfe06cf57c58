"""Issue #15's batch-tier measurement: does a draining batch hurt interactive TTFT, and does
interactive traffic slow the batch?

    python benchmarks/batch_drain.py --model DIR --dtype bfloat16 --out results.jsonl

One `expresslane serve --scheduling-policy deadline` with an SQLite batch store, then:
1. idle: interactive short requests (Poisson, --short-rate) alone for --idle-duration s;
2. alone: a --num-batch request batch (Batch API) drains with nothing else running;
3. during: another batch of the same shape drains while the same interactive traffic runs.
Every prompt is fresh random token ids (no prefix-cache hits across phases). Reported:
interactive TTFT p50/p99 idle vs during the drain (target: p99 <= 1.5x idle) and the
batch's output throughput during vs alone (target: >= 0.8x). One JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import numpy as np
from _shared import emit, start_server, stop_server

from expresslane.bench.client import Endpoint, make_session, send_request
from expresslane.bench.inprocess import random_prompts
from expresslane.bench.stats import distribution


class Prompts:
    """Fresh random token-id prompts (the bench package's): no two share a prefix block."""

    def __init__(self, model_dir: str, seed: int):
        self.vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
        self.rng = random.Random(seed)

    def __call__(self, n: int) -> list[int]:
        return random_prompts(self.rng, self.vocab, [n])[0]


async def shorts(session, ep: Endpoint, args, prompts: Prompts, stop: asyncio.Event | None, duration: float):
    """Poisson interactive shorts until `stop` is set (or for `duration` s); their records."""
    rng = np.random.default_rng(prompts.rng.randrange(1 << 30))
    tasks, end = [], time.monotonic() + duration
    while (stop is None and time.monotonic() < end) or (stop is not None and not stop.is_set()):
        tasks.append(asyncio.create_task(send_request(session, ep, prompts(args.short_len), args.short_len,
                                                      args.short_output, "short", "interactive")))
        await asyncio.sleep(rng.exponential(1.0 / args.short_rate))
    return await asyncio.gather(*tasks)


async def upload(session, url: str, content: bytes, store: str) -> str:
    form = aiohttp.FormData()
    form.add_field("purpose", "batch")
    form.add_field("file", content, filename="batch.jsonl", content_type="application/jsonl")
    async with session.post(url + "/v1/files", data=form) as r:
        if r.status == 200:
            return (await r.json())["id"]
        print(f"POST /v1/files answered {r.status} ({(await r.text())[:200]}); writing the file into the store "
              "directly (is python-multipart installed?)", flush=True)
    from expresslane.batch_api.records import FileRecord, new_id
    from expresslane.batch_api.sqlite_store import SQLiteStore

    db = SQLiteStore(store)
    rec = FileRecord(new_id("file-"), len(content), int(time.time()), "batch.jsonl", "batch")
    db.put_file(rec, content)
    db.close()
    return rec.id


async def drain(session, url: str, model: str, args, prompts: Prompts, store: str) -> dict:
    rows = [{"custom_id": f"b{i}", "method": "POST", "url": "/v1/completions",
             "body": {"model": model, "prompt": prompts(args.batch_input_len), "max_tokens": args.batch_output_len,
                      "temperature": 0.0, "ignore_eos": True}} for i in range(args.num_batch)]
    file_id = await upload(session, url, "".join(json.dumps(r) + "\n" for r in rows).encode(), store)
    body = {"input_file_id": file_id, "endpoint": "/v1/completions", "completion_window": "24h"}
    t0 = time.monotonic()
    async with session.post(url + "/v1/batches", json=body) as r:
        b = await r.json()
    while b["status"] not in ("completed", "failed", "expired", "cancelled"):
        await asyncio.sleep(0.25)
        async with session.get(url + f"/v1/batches/{b['id']}") as r:
            b = await r.json()
    wall = time.monotonic() - t0
    out_tokens = (b.get("usage") or {}).get("output_tokens", 0)
    return {"status": b["status"], "completed": b["request_counts"]["completed"],
            "failed": b["request_counts"]["failed"], "drain_s": round(wall, 2), "output_tokens": out_tokens,
            "output_tok_s": round(out_tokens / wall, 1), "requests_per_s": round(args.num_batch / wall, 2)}


def ttft(records) -> dict:
    ok = [r.ttft for r in records if r.success]
    d = distribution(ok)
    return {"n": len(ok), "failed": len(records) - len(ok), "p50_ms": round(d["p50"], 2),
            "p99_ms": round(d["p99"], 2)}


async def measure(url: str, args: argparse.Namespace, store: str) -> dict:
    async with make_session() as session:
        async with session.get(url + "/v1/models") as r:
            model = (await r.json())["data"][0]["id"]
        ep = Endpoint(url, model, ignore_eos=True)
        await shorts(session, ep, args, Prompts(args.model, 0), None, 2.0)  # warm-up
        print("== idle: interactive shorts alone", flush=True)
        idle = ttft(await shorts(session, ep, args, Prompts(args.model, 1), None, args.idle_duration))
        print("== alone: the batch with nothing else", flush=True)
        alone = await drain(session, url, model, args, Prompts(args.model, 2), store)
        print("== during: the batch while interactive shorts run", flush=True)
        done = asyncio.Event()
        batch = asyncio.create_task(drain(session, url, model, args, Prompts(args.model, 3), store))
        batch.add_done_callback(lambda _: done.set())
        during_records = await shorts(session, ep, args, Prompts(args.model, 4), done, 0)
        during = await batch
        return {"idle": idle, "during": ttft(during_records), "batch_alone": alone, "batch_during": during}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default=None)
    p.add_argument("--num-batch", type=int, default=2000)
    p.add_argument("--batch-input-len", type=int, default=256)
    p.add_argument("--batch-output-len", type=int, default=128)
    p.add_argument("--short-len", type=int, default=64)
    p.add_argument("--short-output", type=int, default=16)
    p.add_argument("--short-rate", type=float, default=4.0, help="interactive requests per second (Poisson)")
    p.add_argument("--idle-duration", type=float, default=20.0)
    p.add_argument("--serve-flags", default="", help="more `expresslane serve` flags, one string")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="batch-drain-") as tmp:
        store, log = os.path.join(tmp, "store.db"), os.path.join(tmp, "serve.log")
        flags = ["--scheduling-policy", "deadline", "--batch-store", f"sqlite:{store}", *shlex.split(args.serve_flags)]
        proc, url = start_server([args.model, *flags, *(["--dtype", args.dtype] if args.dtype else [])], log)
        try:
            r = asyncio.run(measure(url, args, store))
        except BaseException:
            print(Path(log).read_text()[-3000:], file=sys.stderr)
            raise
        finally:
            stop_server(proc, 60.0)
    idle, during = r["idle"], r["during"]
    ttft_ratio = during["p99_ms"] / idle["p99_ms"] if idle["p99_ms"] else None
    alone, busy = r["batch_alone"], r["batch_during"]
    tput_ratio = busy["output_tok_s"] / alone["output_tok_s"] if alone["output_tok_s"] else None
    print(f"interactive TTFT p99: idle {idle['p99_ms']} ms, during the drain {during['p99_ms']} ms "
          f"({ttft_ratio:.2f}x; target <= 1.5x)" if ttft_ratio else "interactive TTFT: no data")
    print(f"batch of {args.num_batch}: alone {alone['output_tok_s']} tok/s in {alone['drain_s']} s, with "
          f"interactive traffic {busy['output_tok_s']} tok/s in {busy['drain_s']} s "
          f"({tput_ratio:.2f}x; target >= 0.8x)" if tput_ratio else "batch throughput: no data")
    emit(args.out, bench="batch_drain", model=os.path.basename(args.model.rstrip("/")), dtype=args.dtype,
         num_batch=args.num_batch, batch_input_len=args.batch_input_len, batch_output_len=args.batch_output_len,
         short_len=args.short_len, short_output=args.short_output, short_rate=args.short_rate,
         serve_flags=args.serve_flags,
         ttft_p99_ratio=round(ttft_ratio, 3) if ttft_ratio else None,
         batch_tput_ratio=round(tput_ratio, 3) if tput_ratio else None, **r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
