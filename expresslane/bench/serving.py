"""Open-loop serving benchmark: send a dataset at a request rate, measure every request.

Arrivals follow vLLM: all at once (rate inf) or a gamma process at ``request_rate``
(burstiness 1 = Poisson; < 1 burstier, > 1 more regular); ``max_concurrency`` then
caps how many are in flight. Before the measured run, ``warmup`` requests warm the
server and ``alone_probes`` short requests, sent one at a time to an idle server,
measure the TTFT a request gets alone: the yardstick for flat latency. Warm-up,
probes and each measured run (each sweep point) draw prompts of their own, so no
measured TTFT is a prefix-cache hit on an earlier request.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections import Counter
from dataclasses import asdict, dataclass
from datetime import datetime

import aiohttp
from tqdm import tqdm

from expresslane.bench import client, slo, stats
from expresslane.bench.arrivals import arrival_offsets
from expresslane.bench.client import Endpoint
from expresslane.bench.datasets import (SYNTHETIC, SampleRequest, Shape, count_file_prompts,
                                        draw_prompts, fit_context, sample_shapes)
from expresslane.bench.prompts import PromptMaker, make_prompt_maker
from expresslane.bench.records import RequestRecord, json_number
from expresslane.bench.stats import measurement
from expresslane.bench.tables import notify
from expresslane.config.bench import ClientOptions, ServingConfig

WARMUP_SALT, PROBE_SALT = 10_000, 20_000  # measured runs use salts 0, 1, ... (sweep points)


@dataclass(slots=True)
class Prepared:
    """What every measured run of one invocation (a sweep has several) shares."""

    session: aiohttp.ClientSession
    endpoint: Endpoint
    maker: PromptMaker
    shapes: list[Shape]
    notices: list[str]
    alone_ttft_ms: float | None = None


async def connect(session: aiohttp.ClientSession, opts: ClientOptions) -> tuple[Endpoint, PromptMaker, list[str]]:
    """The endpoint, a prompt maker with the best tokenizer there is, and notices so far."""
    ep = await client.connect(session, opts)
    maker, notices = await make_prompt_maker(session, ep, opts.tokenizer)
    return ep, maker, notices


async def chat_overhead(ep: Endpoint, maker: PromptMaker) -> int:
    return await maker.tokenizer.chat_overhead() if ep.kind == "chat" and maker.exact else 0


def targets(cfg: ServingConfig) -> tuple[dict[str, float], tuple[slo.SloTarget, ...]]:
    """``--goodput`` and ``--slo``, parsed (ValueError naming a bad item)."""
    return stats.parse_goodput(list(cfg.goodput or ())), slo.parse_slo(cfg.slo)


async def prepare(cfg: ServingConfig, session: aiohttp.ClientSession) -> Prepared:
    targets(cfg)  # a bad target fails before any request
    ep, maker, notices = await connect(session, cfg.client)
    shapes = sample_shapes(cfg.dataset)
    if cfg.dataset.name not in SYNTHETIC:
        shapes = await count_file_prompts(cfg.dataset, shapes, maker)
    shapes, more = fit_context(shapes, ep.max_model_len, await chat_overhead(ep, maker))
    notices += more
    for line in notices:
        notify(line)
    prep = Prepared(session, ep, maker, shapes, notices)
    if cfg.warmup:
        warm = [shapes[i % len(shapes)] for i in range(cfg.warmup)]
        await asyncio.gather(*(send(prep, r) for r in await draw(prep, cfg, warm, WARMUP_SALT)))
    prep.alone_ttft_ms = await alone_ttft_ms(prep, cfg)
    return prep


async def draw(prep: Prepared, cfg: ServingConfig, shapes: list[Shape], salt: int) -> list[SampleRequest]:
    progress = not cfg.disable_tqdm and prep.maker.exact and len(shapes) >= 100
    return await draw_prompts(shapes, prep.maker, cfg.dataset.seed, salt, cfg.dataset.prefix_len, progress)


async def send(prep: Prepared, req: SampleRequest) -> RequestRecord:
    return await client.send_request(prep.session, prep.endpoint, req.prompt, req.prompt_len,
                                     req.output_len, req.length_class, req.lane, req.priority)


async def alone_ttft_ms(prep: Prepared, cfg: ServingConfig) -> float | None:
    """Median TTFT of the shortest prompt length sent alone (a fresh prompt each time);
    None if no probe succeeded."""
    if cfg.alone_probes < 1:
        return None
    shortest = min(prep.shapes, key=lambda s: s.input_len)
    # synthetic even for a file dataset: a file prompt sent again would hit the prefix cache
    probe = Shape(shortest.input_len, 2, shortest.length_class, shortest.lane, shortest.priority)
    ttfts = []
    for i in range(cfg.alone_probes):
        [req] = await draw(prep, cfg, [probe], PROBE_SALT + i)
        rec = await send(prep, req)
        if rec.success:
            ttfts.append(rec.ttft * 1000.0)
    return statistics.median(ttfts) if ttfts else None


async def measure(prep: Prepared, requests: list[SampleRequest], rate: float, burstiness: float,
                  concurrency: int | None, seed: int,
                  disable_tqdm: bool) -> tuple[list[RequestRecord], float, float]:
    """One measured run over all requests: (records, duration, start time)."""
    offsets = arrival_offsets(len(requests), rate, burstiness, seed)
    limit = asyncio.Semaphore(concurrency) if concurrency else None
    bar = tqdm(total=len(requests), disable=disable_tqdm, unit="req", desc="requests")

    async def one(req: SampleRequest) -> RequestRecord:
        if limit is None:
            rec = await send(prep, req)
        else:
            async with limit:
                rec = await send(prep, req)
        bar.update(1)
        return rec

    t0 = time.perf_counter()
    tasks = []
    for req, offset in zip(requests, offsets):
        if (wait := t0 + offset - time.perf_counter()) > 0:
            await asyncio.sleep(wait)
        tasks.append(asyncio.create_task(one(req)))
    records = await asyncio.gather(*tasks)
    duration = time.perf_counter() - t0
    bar.close()
    await prep.maker.recount_outputs(records)
    return list(records), duration, t0


def run_facts(ep: Endpoint, maker: PromptMaker, notices: list[str],
              records: list[RequestRecord]) -> dict:
    """What every HTTP result says about how it was measured."""
    return {
        "backend": "openai-chat" if ep.kind == "chat" else "openai",
        "base_url": ep.base_url,
        "endpoint": ep.url,
        "model_id": ep.model,
        "max_model_len": ep.max_model_len,
        "request_body_extra": ep.body,
        "ignore_eos": ep.ignore_eos,
        "prompt_lengths": maker.source,
        "output_counts": dict(Counter(r.output_count for r in records if r.success)),
        "notices": notices,
    }


def build_result(cfg: ServingConfig, prep: Prepared, records: list[RequestRecord],
                 duration: float, t0: float, rate: float, concurrency: int | None) -> dict:
    spec = cfg.dataset
    goodput, slo_targets = targets(cfg)
    result = {
        "kind": "serving",
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        **run_facts(prep.endpoint, prep.maker, prep.notices, records),
        "dataset": spec.name,
        "dataset_config": {k: v for k, v in asdict(spec).items() if k not in ("name", "seed")},
        "num_prompts": len(records),
        "request_rate": json_number(rate),
        "burstiness": cfg.burstiness,
        "max_concurrency": concurrency,
        "seed": spec.seed,
        "goodput_config": goodput or None,
        "alone_ttft_ms": prep.alone_ttft_ms,
        **measurement(records, duration, t0, goodput),
    }
    result["slo"] = slo.judge(result, slo_targets)
    return result


async def run_point(cfg: ServingConfig, prep: Prepared, rate: float, concurrency: int | None,
                    salt: int = 0) -> dict:
    requests = await draw(prep, cfg, prep.shapes, salt)
    records, duration, t0 = await measure(prep, requests, rate, cfg.burstiness, concurrency,
                                          cfg.dataset.seed, cfg.disable_tqdm)
    return build_result(cfg, prep, records, duration, t0, rate, concurrency)


async def benchmark_serving(cfg: ServingConfig) -> dict:
    async with client.make_session() as session:
        prep = await prepare(cfg, session)
        return await run_point(cfg, prep, cfg.request_rate, cfg.max_concurrency)


def run_serving(cfg: ServingConfig) -> dict:
    """Run one serving benchmark and return its result."""
    return asyncio.run(benchmark_serving(cfg))
