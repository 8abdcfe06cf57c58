"""Open-loop serving benchmark: send a dataset at a request rate, measure every request.

Arrivals follow vLLM: all at once (rate inf) or a gamma process at ``request_rate``
(burstiness 1 = Poisson; < 1 burstier, > 1 more regular); ``max_concurrency`` then
caps how many are in flight. Before the measured run, ``warmup`` requests warm the
server and ``alone_probes`` short requests, sent one at a time to an idle server,
measure the TTFT a request gets alone: the yardstick for flat latency.
"""

from __future__ import annotations

import asyncio
import math
import statistics
import time
from dataclasses import dataclass, field, replace
from datetime import datetime

import aiohttp
import numpy as np
from tqdm import tqdm

from expresslane.bench import client, slo
from expresslane.bench.client import Endpoint
from expresslane.bench.datasets import DatasetSpec, SampleRequest, sample_requests
from expresslane.bench.records import RequestRecord, json_number
from expresslane.bench.stats import measurement


@dataclass(frozen=True, slots=True)
class ServingConfig:
    base_url: str
    model: str | None = None  # None: the first model of GET /v1/models
    endpoint: str = "completions"
    dataset: DatasetSpec = field(default_factory=DatasetSpec)
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    warmup: int = 0
    alone_probes: int = 3
    ignore_eos: bool = False
    goodput: dict[str, float] = field(default_factory=dict)
    slo: tuple[slo.SloTarget, ...] = field(default_factory=lambda: slo.parse_slo(None))
    disable_tqdm: bool = False


@dataclass(slots=True)
class Prepared:
    """What every measured run of one invocation (a sweep has several) shares."""

    session: aiohttp.ClientSession
    endpoint: Endpoint
    requests: list[SampleRequest]
    tokens_per_word: float
    calibrated: bool
    alone_ttft_ms: float | None = None


def arrival_offsets(n: int, rate: float, burstiness: float, seed: int) -> np.ndarray:
    """Send time of each request, seconds after the start (cumulative, so no drift)."""
    if rate <= 0 or burstiness <= 0:
        raise ValueError(f"request rate and burstiness must be positive, got {rate}, {burstiness}")
    if math.isinf(rate):
        return np.zeros(n)
    gaps = np.random.default_rng(seed).gamma(burstiness, 1.0 / (rate * burstiness), n)
    gaps[0] = 0.0  # the first request starts the clock
    return np.cumsum(gaps)


async def prepare(cfg: ServingConfig, session: aiohttp.ClientSession) -> Prepared:
    model = cfg.model or await client.fetch_model(session, cfg.base_url)
    ep = Endpoint(cfg.base_url, model, cfg.endpoint, cfg.ignore_eos)
    ratio = await client.tokens_per_word(session, ep.base_url, model)
    requests = sample_requests(cfg.dataset, ratio or 1.0)
    prep = Prepared(session, ep, requests, ratio or 1.0, ratio is not None)
    if cfg.warmup:
        warm = [requests[i % len(requests)] for i in range(cfg.warmup)]
        await asyncio.gather(*(client.send_request(session, ep, r) for r in warm))
    prep.alone_ttft_ms = await alone_ttft_ms(prep, cfg.alone_probes)
    return prep


async def alone_ttft_ms(prep: Prepared, probes: int) -> float | None:
    """Median TTFT of the shortest prompt sent alone; None if no probe succeeded."""
    if probes < 1:
        return None
    shortest = replace(min(prep.requests, key=lambda r: r.prompt_len), output_len=2)
    ttfts = []
    for _ in range(probes):
        rec = await client.send_request(prep.session, prep.endpoint, shortest)
        if rec.success:
            ttfts.append(rec.ttft * 1000.0)
    return statistics.median(ttfts) if ttfts else None


async def measure(prep: Prepared, rate: float, burstiness: float, concurrency: int | None,
                  seed: int, disable_tqdm: bool) -> tuple[list[RequestRecord], float, float]:
    """One measured run over all requests: (records, duration, start time)."""
    offsets = arrival_offsets(len(prep.requests), rate, burstiness, seed)
    limit = asyncio.Semaphore(concurrency) if concurrency else None
    bar = tqdm(total=len(prep.requests), disable=disable_tqdm, unit="req")

    async def one(req: SampleRequest) -> RequestRecord:
        if limit is None:
            rec = await client.send_request(prep.session, prep.endpoint, req)
        else:
            async with limit:
                rec = await client.send_request(prep.session, prep.endpoint, req)
        bar.update(1)
        return rec

    t0 = time.perf_counter()
    tasks = []
    for req, offset in zip(prep.requests, offsets):
        if (wait := t0 + offset - time.perf_counter()) > 0:
            await asyncio.sleep(wait)
        tasks.append(asyncio.create_task(one(req)))
    records = await asyncio.gather(*tasks)
    duration = time.perf_counter() - t0
    bar.close()
    return list(records), duration, t0


def build_result(cfg: ServingConfig, prep: Prepared, records: list[RequestRecord],
                 duration: float, t0: float, rate: float, concurrency: int | None) -> dict:
    ep = prep.endpoint
    result = {
        "kind": "serving",
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": "openai-chat" if ep.kind == "chat" else "openai",
        "base_url": ep.base_url,
        "endpoint": ep.url,
        "model_id": ep.model,
        "dataset": cfg.dataset.name,
        "num_prompts": len(records),
        "request_rate": json_number(rate),
        "burstiness": cfg.burstiness,
        "max_concurrency": concurrency,
        "seed": cfg.dataset.seed,
        "ignore_eos": cfg.ignore_eos,
        "tokens_per_word": prep.tokens_per_word,
        "prompt_lengths": "tokenize" if prep.calibrated else "estimate",
        "goodput_config": cfg.goodput or None,
        "alone_ttft_ms": prep.alone_ttft_ms,
        **measurement(records, duration, t0, cfg.goodput),
    }
    result["slo"] = slo.judge(result, cfg.slo)
    return result


async def run_point(cfg: ServingConfig, prep: Prepared, rate: float,
                    concurrency: int | None) -> dict:
    records, duration, t0 = await measure(prep, rate, cfg.burstiness, concurrency,
                                          cfg.dataset.seed, cfg.disable_tqdm)
    return build_result(cfg, prep, records, duration, t0, rate, concurrency)


async def benchmark_serving(cfg: ServingConfig) -> dict:
    async with client.make_session() as session:
        prep = await prepare(cfg, session)
        return await run_point(cfg, prep, cfg.request_rate, cfg.max_concurrency)


def run_serving(cfg: ServingConfig) -> dict:
    """Run one serving benchmark and return its result (see DESIGN §5)."""
    return asyncio.run(benchmark_serving(cfg))
