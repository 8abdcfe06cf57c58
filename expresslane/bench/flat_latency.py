"""The flat-latency experiment (the background article's), end to end.

Per row (a batching mode of an in-process engine, the transformers baseline, or a
server at ``--base-url``), with prompts of random tokens:

  (a) alone   one prompt at a time, of growing length: does TTFT grow with the work?
  (b) mixed   ``num_short`` short prompts submitted together, first without, then
              with one long prompt submitted just before them ("long first")

    flatness = median short TTFT mixed / median short TTFT alone

1.0 means a short request does not notice the long one; a large value is flat latency:
the short request waits about as long as the long one. The row also keeps when each
short request's first token came relative to the long one's (in-process these are the
engine's step stamps: 0.0 is the same step, negative is ahead of it). Each row gets its own engine,
warmed up by one untimed mixed submission; the scenarios are interleaved ``repeats``
times so that drift in the machine's speed hits every scenario alike.
"""

from __future__ import annotations

import dataclasses
from contextlib import closing
from datetime import datetime

import torch
from tqdm import tqdm

from expresslane.bench.inprocess import MODES
from expresslane.bench.records import RequestRecord
from expresslane.bench.stats import distribution
from expresslane.bench.tables import fmt, notify, text_table
from expresslane.config.bench import FlatLatencyConfig

# In the mixed scenario the long prompt is sent in the batch lane and the short ones in
# the interactive lane; only the `deadline` policy (continuous-lanes) acts on lanes.
PROMPT_SEED = 0  # every row draws the same prompts in the same order


def engine_args(cfg: FlatLatencyConfig, mode: str) -> dict:
    n = cfg.num_short + 1
    defaults = {
        "max_num_batched_tokens": 256,  # below long_len: continuous batching chunks the long prompt
        "max_batch_size": n,  # a static/dynamic batch holds the whole mixed submission
        "max_num_seqs": n,  # never binding here; sizes the KV cache for n requests (fast CPU start)
    }
    return {**defaults, **cfg.engine_args, **MODES[mode]}


def capped_lens(cfg: FlatLatencyConfig, max_model_len: int | None,
                over_http: bool = False) -> tuple[list[int], FlatLatencyConfig, list[str]]:
    """(a)'s lengths, each at most what leaves room for ``output_len`` tokens; over HTTP
    the short and long prompts are capped too (in-process, a misfit is the user's flag)."""
    if max_model_len is None:
        return sorted(set(cfg.input_lens)), cfg, []
    cap = max_model_len - cfg.output_len
    if cap < 1:
        raise ValueError(f"{cfg.output_len} output tokens leave no room for a prompt in the "
                         f"model's context of {max_model_len}")
    notices = []
    longest = max(cfg.long_len, cfg.short_len)
    if longest > cap:
        if not over_http:
            raise ValueError(f"prompts of {longest} tokens plus {cfg.output_len} output tokens do "
                             f"not fit the model's context of {max_model_len}")
        cfg = dataclasses.replace(cfg, long_len=min(cfg.long_len, cap), short_len=min(cfg.short_len, cap))
        notices.append(f"the long prompt ({longest} tokens) does not fit the model's context "
                       f"({max_model_len}) with {cfg.output_len} output tokens: capped to {cap}")
    lens = sorted({min(n, cap) for n in cfg.input_lens})
    if max(cfg.input_lens) > cap:
        notices.append(f"(a) lengths over {cap} tokens are capped to {cap} (the model's context "
                       f"{max_model_len} less {cfg.output_len} output tokens)")
    return lens, cfg, notices


def median_ms(records: list[RequestRecord]) -> float | None:
    ttfts = [r.ttft for r in records if r.success]
    return distribution(ttfts)["median"] if ttfts else None


def measure(target, cfg: FlatLatencyConfig, lens: list[int], bar: tqdm) -> dict:
    """Both scenarios on one target; TTFTs are medians over every repeat. Every
    submission draws fresh prompts (the warm-up too), so none hits the prefix cache."""
    shorts = [cfg.short_len] * cfg.num_short
    target.submit([cfg.long_len, *shorts], cfg.output_len)  # warm-up: every shape below, untimed
    bar.update(1)
    alone: dict[int, list[RequestRecord]] = {n: [] for n in lens}
    short_alone, short_mixed, long_mixed, vs_long = [], [], [], []
    for _ in range(cfg.repeats):
        for n in lens:
            alone[n] += target.submit([n], cfg.output_len)
        short_alone += target.submit(shorts, cfg.output_len)
        long_rec, *short_recs = target.submit([cfg.long_len, *shorts], cfg.output_len,
                                              lanes=["batch"] + ["interactive"] * len(shorts))
        long_mixed.append(long_rec)
        short_mixed += short_recs
        if long_rec.success:  # in-process: engine step stamps, so 0.0 means "the same step"
            long_first = long_rec.start + long_rec.ttft
            vs_long += [(r.start + r.ttft - long_first) * 1000.0 for r in short_recs if r.success]
        bar.update(1)
    everything = [r for recs in alone.values() for r in recs]
    everything += short_alone + short_mixed + long_mixed
    s_alone, s_mixed = median_ms(short_alone), median_ms(short_mixed)
    return {
        "ttft_alone_ms": [{"input_len": n, "ttft_ms": median_ms(recs)}
                          for n, recs in alone.items()],
        "short_alone_ttft_ms": s_alone,
        "short_mixed_ttft_ms": s_mixed,
        "long_mixed_ttft_ms": median_ms(long_mixed),
        "flatness": s_mixed / s_alone if s_alone and s_mixed is not None else None,
        # per-request TTFTs in seconds (vLLM's unit), successful requests only
        "short_alone_ttfts": [r.ttft for r in short_alone if r.success],
        "short_mixed_ttfts": [r.ttft for r in short_mixed if r.success],
        "long_mixed_ttfts": [r.ttft for r in long_mixed if r.success],
        # mixed: each short request's first token, ms after (> 0) or before (< 0) the long one's
        "short_first_token_vs_long_ms": vs_long,
        "failed": sum(not r.success for r in everything),
        "errors": list(dict.fromkeys(r.error for r in everything if not r.success)),  # distinct
    }


def run_flat_latency(cfg: FlatLatencyConfig) -> dict:
    from expresslane.bench.targets import EngineTarget, HFTarget, HttpTarget

    cfg.validate()
    names = ["server"] if cfg.http else [*cfg.modes, *([cfg.baseline] if cfg.baseline else [])]
    bar = tqdm(total=len(names) * (1 + cfg.repeats), disable=cfg.disable_tqdm, unit="round",
               desc="flat-latency")
    result = {"kind": "flat-latency", "date": datetime.now().strftime("%Y%m%d-%H%M%S")}
    rows, notices = [], []
    if cfg.http is not None:
        bar.set_postfix_str("server")
        with closing(HttpTarget(cfg.http, PROMPT_SEED)) as http:
            lens, cfg, notices = capped_lens(cfg, http.max_model_len, over_http=True)
            notices = http.notices + notices
            for line in notices:
                notify(line)
            rows.append({"mode": "server", **measure(http, cfg, lens, bar)})
        ep = http.endpoint
        facts = {"target": "http", "base_url": ep.base_url, "endpoint": ep.url, "model_id": ep.model,
                 "max_model_len": ep.max_model_len, "prompt_lengths": http.maker.source,
                 "device": None, "dtype": None}
    else:
        for mode in cfg.modes:
            bar.set_postfix_str(mode)
            args = engine_args(cfg, mode)
            with closing(EngineTarget(cfg.model, args, PROMPT_SEED)) as engine:
                lens, cfg, said = capped_lens(cfg, engine.max_model_len)
                for line in said if not notices else []:  # every engine has the same context
                    notify(line)
                notices = notices or said
                rows.append({"mode": mode, "engine_args": args, **measure(engine, cfg, lens, bar)})
        facts = {"target": "in-process", "base_url": None, "model_id": str(engine.model_dir),
                 "max_model_len": engine.max_model_len, "prompt_lengths": "exact (token ids)",
                 "device": str(engine.device), "dtype": str(engine.dtype).removeprefix("torch.")}
        if cfg.baseline == "hf":  # after the engines are gone: it needs the memory they held
            bar.set_postfix_str("hf")
            hf_target = HFTarget(engine.model_dir, engine.device, engine.dtype, PROMPT_SEED)
            with closing(hf_target) as hf:
                rows.append({"mode": "hf", **measure(hf, cfg, lens, bar)})
    bar.close()
    settings = {k: v for k, v in dataclasses.asdict(cfg).items()
                if k not in ("model", "modes", "engine_args", "http", "disable_tqdm")}
    result |= {**settings, **facts, "num_threads": torch.get_num_threads(), "notices": notices,
               "input_lens": lens, "rows": rows}
    return result


def format_flat_latency(r: dict) -> str:
    where = r["base_url"] or f"{r['device']}, {r['dtype']}, {r['num_threads']} threads"
    n, s, lg = r["num_short"], r["short_len"], r["long_len"]
    alone = (["mode"] + [f"{x} tok" for x in r["input_lens"]],
             [[row["mode"]] + [fmt(a["ttft_ms"]) for a in row["ttft_alone_ms"]]
              for row in r["rows"]])
    mixed = (["mode", f"{n}x{s} tok alone", f"{n}x{s} tok mixed", f"the {lg}-tok one", "flatness"],
             [[row["mode"], fmt(row["short_alone_ttft_ms"]), fmt(row["short_mixed_ttft_ms"]),
               fmt(row["long_mixed_ttft_ms"]),
               "-" if row["flatness"] is None else f"{row['flatness']:.2f}x"]
              for row in r["rows"]])
    out = [f"{' Flat Latency ':=^72}",
           f"model {r['model_id']} ({where}); TTFT in ms, median of {r['repeats']} repeats",
           "", "(a) one prompt alone, by prompt length", text_table(alone),
           "", f"(b) {n} short prompts of {s} tokens sent together: alone, and mixed with one "
               f"{lg}-token prompt sent first",
           text_table(mixed),
           "flatness = short TTFT mixed / alone (1.00x: the long prompt costs them nothing)"]
    out += [f"notice: {line}" for line in r.get("notices") or []]
    if failed := sum(row["failed"] for row in r["rows"]):
        out.append(f"{failed} requests failed; the first distinct messages (all in the JSON):")
        out += [f"  {e}" for e in dict.fromkeys(e for row in r["rows"] for e in row["errors"])][:5]
    out.append("=" * 72)
    return "\n".join(out)
