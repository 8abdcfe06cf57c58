"""Server overhead (``bench server-overhead``): TTFT through HTTP minus the engine's own.

Each request is a streamed completion of one token with ``return_metrics: true``
(expresslane's extension: the response carries the engine's monotonic timestamps).
The engine's TTFT is ``first_token_time - engine_arrival_time`` (from the moment the
engine process took the request to its first token); everything else the client
waits for is overhead: HTTP and JSON, validation, tokenization, admission, the
ZeroMQ hop both ways, detokenization and SSE. When client and server share one
monotonic clock (the same Linux host), the overhead also splits into "in" (sent ->
the engine took it) and "out" (first token -> the client has it).

Two runs: ``sequential`` requests one at a time (overhead alone), then
``concurrency`` closed-loop streams of ``rounds`` requests each (overhead under load:
the API process's event loop is shared). Every request has a fresh prompt.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from datetime import datetime

import numpy as np
from tqdm import tqdm

from expresslane.bench import client
from expresslane.bench.records import RequestRecord, first_errors
from expresslane.bench.serving import connect, run_facts
from expresslane.bench.stats import distribution
from expresslane.bench.tables import notify
from expresslane.config.bench import OverheadConfig

PARTS = ("http_ttft", "engine_ttft", "overhead", "in", "out")
# perf_counter (the client's clock) and monotonic (the engine's) read the same clock here?
SHARED_CLOCK = (time.get_clock_info("perf_counter").implementation
                == time.get_clock_info("monotonic").implementation)


def parts(rec: RequestRecord) -> dict[str, float] | None:
    """One request's TTFT split, in seconds; None if it failed or carried no metrics."""
    m = rec.server_metrics
    if not rec.success or not m or m.get("engine_arrival_time") is None or m.get("first_token_time") is None:
        return None
    engine = m["first_token_time"] - m["engine_arrival_time"]
    out = {"http_ttft": rec.ttft, "engine_ttft": engine, "overhead": rec.ttft - engine}
    if SHARED_CLOCK:
        out |= {"in": m["engine_arrival_time"] - rec.start,
                "out": rec.start + rec.ttft - m["first_token_time"]}
    return out


def summarize(records: list[RequestRecord]) -> dict:
    """Per part: distribution in ms over the requests that carried metrics."""
    split = [p for r in records if (p := parts(r)) is not None]
    out: dict = {"requests": len(records), "measured": len(split),
                 "failed": sum(not r.success for r in records),
                 "errors": [f"x{n}  {msg}" for msg, n in first_errors([r.error for r in records])]}
    for key in PARTS:
        values = [p[key] for p in split if key in p]
        out[key] = distribution(values) if values else None
    return out


async def measure(cfg: OverheadConfig) -> dict:
    async with client.make_session() as session:
        ep, maker, notices = await connect(session, cfg.client)
        ep = replace(ep, ignore_eos=True, body={**ep.body, "return_metrics": True})
        for line in notices:
            notify(line)
        rng = np.random.default_rng(cfg.seed)
        total = cfg.warmup + cfg.sequential + cfg.concurrency * cfg.rounds
        bar = tqdm(total=total, disable=cfg.disable_tqdm, unit="req", desc="server-overhead")

        async def one() -> RequestRecord:
            text, n = await maker.prompt(rng, cfg.prompt_len)  # fresh: no prefix-cache hit
            rec = await client.send_request(session, ep, text, n, 1)
            bar.update(1)
            return rec

        for _ in range(cfg.warmup):
            await one()
        seq = [await one() for _ in range(cfg.sequential)]

        async def stream() -> list[RequestRecord]:
            return [await one() for _ in range(cfg.rounds)]

        t0 = time.perf_counter()
        conc = [r for batch in await asyncio.gather(*(stream() for _ in range(cfg.concurrency)))
                for r in batch]
        elapsed = time.perf_counter() - t0
        bar.close()
    if not any(r.server_metrics for r in seq + conc if r.success):
        notices.append("the server sent no return_metrics timestamps (an expresslane server "
                       "does): only the HTTP TTFT is measured")
        notify(notices[-1])
    return {
        "kind": "server-overhead",
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        **run_facts(ep, maker, notices, seq + conc),
        "prompt_len": cfg.prompt_len,
        "shared_clock": SHARED_CLOCK,
        "sequential": summarize(seq),
        "concurrent": {**summarize(conc), "concurrency": cfg.concurrency, "rounds": cfg.rounds,
                       "requests_per_s": len(conc) / elapsed},
    }


def run_overhead(cfg: OverheadConfig) -> dict:
    for name in ("sequential", "concurrency", "rounds", "prompt_len"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(cfg, name)}")
    return asyncio.run(measure(cfg))


def format_overhead(r: dict) -> str:
    out = [f"{' Server Overhead ':=^72}",
           f"model {r['model_id']} at {r['base_url']}; 1-token requests of {r['prompt_len']} prompt "
           "tokens; ms"]
    for name in ("sequential", "concurrent"):
        s = r[name]
        title = (f"{name}: {s['measured']} of {s['requests']} requests measured"
                 + (f", {s['concurrency']} streams, {s['requests_per_s']:.1f} req/s" if name == "concurrent" else ""))
        out += ["", title, f"{'':<12}{'p50':>10}{'p90':>10}{'p99':>10}{'mean':>10}"]
        for key in PARTS:
            if (d := s[key]) is not None:
                out.append(f"{key:<12}" + "".join(f"{d[k]:>10.3f}" for k in ("p50", "p90", "p99", "mean")))
        out += [f"  {e}" for e in s["errors"]]
    out += [f"notice: {n}" for n in r["notices"]]
    out.append("overhead = HTTP TTFT - engine TTFT; in = sent -> engine took it; out = first token -> client")
    out.append("=" * 72)
    return "\n".join(out)
