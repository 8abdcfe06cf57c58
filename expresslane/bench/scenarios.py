"""The flat-latency scenarios of issue #20, against any OpenAI-compatible server.

  beside-long  ``num_short`` short prompts sent together, alone, then ``lead_ms`` after one
               long prompt: short TTFT, total time and ITL in each, the long one's TTFT
  mixed        open-loop Poisson arrivals at ``rate`` for ``duration`` s, ``long_fraction``
               of them long: short TTFT p50/p99, short ITL p99, long TTFT p50, errors
  goodput      the same mix at each of ``rates``: good requests per second under the SLO
               (short: TTFT and mean TPOT within their targets; long: TTFT within its target)
  isolated     one prompt at a time, by length: TTFT, and batch-1 ITL

Lengths follow the server's context (``max_model_len`` from ``/v1/models``): a long prompt
or an isolated length that would not fit with its output is cut to fit, and the result
says so, so the same command runs against an 8B model on a GPU and the tiny CPU model.
Every prompt is fresh (no prefix-cache hit) and drawn before its scenario's clock starts;
``ignore_eos`` is always sent, so every request generates ``output_len`` tokens.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field, replace
from datetime import datetime

import aiohttp
import numpy as np

from expresslane.bench import client
from expresslane.bench.client import Endpoint
from expresslane.bench.prompts import PromptMaker
from expresslane.bench.records import RequestRecord
from expresslane.bench.arrivals import GOODPUT_SALT, MIXED_SALT, load_arrivals
from expresslane.bench.serving import connect, run_facts
from expresslane.bench.stats import distribution
from expresslane.config.bench import ScenarioConfig



@dataclass(slots=True)
class Probe:
    """A connected server: what every scenario sends through."""

    session: aiohttp.ClientSession
    endpoint: Endpoint
    maker: PromptMaker
    notices: list[str]
    short_len: int
    long_len: int
    rng: np.random.Generator = field(default_factory=lambda: np.random.default_rng(0))

    async def prompts(self, lengths: list[int]) -> list[tuple[str, int]]:
        return list(await asyncio.gather(*(self.maker.prompt(self.rng, n) for n in lengths)))

    async def send(self, prompt: tuple[str, int], output_len: int, cls: str, lane: str | None) -> RequestRecord:
        return await client.send_request(self.session, self.endpoint, prompt[0], prompt[1], output_len, cls, lane)


def fit_lengths(cfg: ScenarioConfig, max_model_len: int | None) -> tuple[int, list[int], list[str]]:
    """The long prompt and isolated lengths cut to the context, with a notice for each cut."""
    if max_model_len is None:
        return cfg.long_len, sorted(set(cfg.isolated_lens)), []
    cap = max_model_len - cfg.output_len - 1
    if cap < cfg.short_len:
        raise ValueError(f"the server's context ({max_model_len}) cannot hold a {cfg.short_len}-token "
                         f"prompt and {cfg.output_len} output tokens")
    notices = []
    long_len = min(cfg.long_len, cap)
    if long_len < cfg.long_len:
        notices.append(f"long prompts are {long_len} tokens, not {cfg.long_len}: the server's context is "
                       f"{max_model_len} tokens")
    return long_len, sorted({min(n, cap) for n in cfg.isolated_lens}), notices


async def open_probe(session: aiohttp.ClientSession, cfg: ScenarioConfig) -> Probe:
    ep, maker, notices = await connect(session, replace(cfg.client, ignore_eos=True))
    long_len, _, more = fit_lengths(cfg, ep.max_model_len)
    return Probe(session, ep, maker, notices + more, cfg.short_len, long_len, np.random.default_rng(cfg.seed))


def ms(values_s: list[float], stat: str) -> float | None:
    return distribution(values_s)[stat] if values_s else None


def summarize_shorts(records: list[RequestRecord]) -> dict:
    ok = [r for r in records if r.success]
    return {
        "short_ttft_ms": ms([r.ttft for r in ok], "median"),
        "short_total_ms": ms([r.latency for r in ok], "median"),
        "short_itl_p50_ms": ms([g for r in ok for g in r.itl], "median"),
        "short_itl_p99_ms": ms([g for r in ok for g in r.itl], "p99"),
        "short_tpot_ms": ms([r.tpot for r in ok if r.tpot is not None], "median"),
        "failed": len(records) - len(ok),
    }


# -- isolated ----------------------------------------------------------------------------
async def isolated(p: Probe, cfg: ScenarioConfig, lens: list[int]) -> dict:
    """TTFT of each length sent alone (median of repeats), and the batch-1 ITL."""
    ttft: dict[int, list[float]] = {n: [] for n in lens}
    itl: list[float] = []
    failed = 0
    for _ in range(cfg.repeats):
        for n in lens:
            [prompt] = await p.prompts([n])
            rec = await p.send(prompt, cfg.output_len, "long" if n > p.short_len else "short", None)
            failed += not rec.success
            if rec.success:
                ttft[n].append(rec.ttft)
                itl += rec.itl
    return {"ttft_ms": {str(n): ms(v, "median") for n, v in ttft.items()},
            "batch1_itl_ms": ms(itl, "median"), "failed": failed}


# -- beside a long prompt -------------------------------------------------------------------
async def burst(p: Probe, cfg: ScenarioConfig, with_long: bool) -> tuple[list[RequestRecord], RequestRecord | None]:
    shorts = await p.prompts([p.short_len] * cfg.num_short)
    long_task = None
    if with_long:
        [long_prompt] = await p.prompts([p.long_len])
        long_task = asyncio.create_task(p.send(long_prompt, cfg.output_len, "long", cfg.long_lane))
        await asyncio.sleep(cfg.lead_ms / 1000)
    records = await asyncio.gather(*(p.send(s, cfg.output_len, "short", None) for s in shorts))
    return list(records), (await long_task if long_task else None)


async def beside_long(p: Probe, cfg: ScenarioConfig) -> dict:
    """The shorts alone and beside the long prompt, interleaved `repeats` times (drift hits both)."""
    alone, beside, longs = [], [], []
    for _ in range(cfg.repeats):
        alone += (await burst(p, cfg, False))[0]
        recs, long_rec = await burst(p, cfg, True)
        beside += recs
        longs.append(long_rec)
    long_alone = []
    for _ in range(cfg.repeats):
        [prompt] = await p.prompts([p.long_len])
        long_alone.append(await p.send(prompt, cfg.output_len, "long", cfg.long_lane))
    out = {"alone": summarize_shorts(alone), "beside": summarize_shorts(beside),
           "long_ttft_ms": ms([r.ttft for r in longs if r.success], "median"),
           "long_alone_ttft_ms": ms([r.ttft for r in long_alone if r.success], "median"),
           "long_failed": sum(not r.success for r in longs + long_alone)}
    a, b = out["alone"], out["beside"]
    out["ratios"] = {
        "short_ttft": ratio(b["short_ttft_ms"], a["short_ttft_ms"]),
        "short_total": ratio(b["short_total_ms"], a["short_total_ms"]),
        "short_itl_p99": ratio(b["short_itl_p99_ms"], a["short_itl_p50_ms"]),
        "long_ttft": ratio(out["long_ttft_ms"], out["long_alone_ttft_ms"]),
    }
    return out


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


# -- open-loop mixed load -----------------------------------------------------------------------
async def open_loop(p: Probe, cfg: ScenarioConfig, rate: float, duration: float, salt: int) -> list[RequestRecord]:
    arrivals = load_arrivals(cfg.seed, salt, rate, duration, cfg.long_fraction)
    prompts = await p.prompts([p.long_len if long else p.short_len for _, long in arrivals])
    t0 = time.perf_counter()
    tasks = []
    for prompt, (offset, long) in zip(prompts, arrivals):
        if (wait := t0 + offset - time.perf_counter()) > 0:
            await asyncio.sleep(wait)
        tasks.append(asyncio.create_task(
            p.send(prompt, cfg.output_len, "long" if long else "short", cfg.long_lane if long else None)))
    return list(await asyncio.gather(*tasks))


def is_good(r: RequestRecord, cfg: ScenarioConfig) -> bool:
    if not r.success:
        return False
    if r.length_class == "long":
        return r.ttft * 1e3 <= cfg.long_ttft_ms
    return r.ttft * 1e3 <= cfg.short_ttft_ms and (r.tpot or 0.0) * 1e3 <= cfg.short_tpot_ms


def summarize_load(records: list[RequestRecord], cfg: ScenarioConfig, duration: float) -> dict:
    shorts = [r for r in records if r.success and r.length_class == "short"]
    longs = [r for r in records if r.success and r.length_class == "long"]
    good = sum(is_good(r, cfg) for r in records)
    return {
        "requests": len(records),
        "short_ttft_p50_ms": ms([r.ttft for r in shorts], "p50"),
        "short_ttft_p99_ms": ms([r.ttft for r in shorts], "p99"),
        "short_itl_p99_ms": ms([g for r in shorts for g in r.itl], "p99"),
        "short_total_p50_ms": ms([r.latency for r in shorts], "p50"),
        "long_ttft_p50_ms": ms([r.ttft for r in longs], "p50"),
        "good_per_s": good / duration,
        "good_fraction": good / len(records) if records else 0.0,
        "failed": sum(not r.success for r in records),
        "errors": sorted({r.error for r in records if not r.success})[:5],
    }


async def mixed(p: Probe, cfg: ScenarioConfig) -> dict:
    return {"rate": cfg.rate, **summarize_load(await open_loop(p, cfg, cfg.rate, cfg.duration, MIXED_SALT), cfg,
                                               cfg.duration)}


async def goodput(p: Probe, cfg: ScenarioConfig) -> dict:
    points = []
    for i, rate in enumerate(cfg.rates):
        records = await open_loop(p, cfg, rate, cfg.sweep_duration, GOODPUT_SALT + i)
        points.append({"rate": rate, **summarize_load(records, cfg, cfg.sweep_duration)})
    peak = max(points, key=lambda x: x["good_per_s"])
    return {"points": points, "peak_good_per_s": peak["good_per_s"], "peak_rate": peak["rate"]}


# -- all of them -------------------------------------------------------------------------------
async def measure(p: Probe, cfg: ScenarioConfig) -> dict:
    _, lens, _ = fit_lengths(cfg, p.endpoint.max_model_len)
    [warm] = await p.prompts([p.long_len])  # first-use costs (kernels, allocator) are nobody's TTFT
    recs = await asyncio.gather(p.send(warm, cfg.output_len, "long", None),
                                *(p.send(s, cfg.output_len, "short", None) for s in await p.prompts([p.short_len] * 4)))
    if failed := [r for r in recs if not r.success]:
        raise RuntimeError(f"{len(failed)} of {len(recs)} warm-up requests failed, e.g. {failed[0].error}")
    out: dict = {}
    if "isolated" in cfg.run:
        out["isolated"] = await isolated(p, cfg, lens)
    if "beside-long" in cfg.run:
        out["beside_long"] = await beside_long(p, cfg)
    if "mixed" in cfg.run:
        out["mixed"] = await mixed(p, cfg)
    if "goodput" in cfg.run:
        out["goodput"] = await goodput(p, cfg)
    return out


async def _run(cfg: ScenarioConfig) -> dict:
    cfg.validate()
    async with client.make_session() as session:
        p = await open_probe(session, cfg)
        measured = await measure(p, cfg)
    return {"kind": "flat-scenarios", "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
            **run_facts(p.endpoint, p.maker, p.notices, []), **cfg.settings(),
            "long_len_used": p.long_len, **measured}


def run_scenarios(cfg: ScenarioConfig) -> dict:
    return asyncio.run(_run(cfg))
