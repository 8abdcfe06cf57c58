"""Benchmark datasets without downloads: request shapes, then fresh prompts of those shapes.

A dataset first fixes every request's *shape* (prompt and output lengths, class, lane),
deterministic for a seed. Prompt text is drawn afterwards, anew for every use (each
sweep point, the warm-up, each probe: ``salt`` tells them apart), by ``prompts.py``,
which makes lengths exact with the model's tokenizer when there is one.

Datasets:
  random             input/output lengths uniform in len*(1-r)..len*(1+r) (vLLM's random)
  sharegpt-like      log-normal lengths shaped like chat logs: median at the given
                     lengths, long right tail (sigma 1.0 input, 0.8 output), clipped
  mixed              the flat-latency mix: a fraction of long prompts among short ones
  prefix-repetition  random lengths whose first ``prefix_len`` tokens are one of
                     ``num_prefixes`` shared prefixes: prefix-cache hits on purpose
                     (vLLM's prefix_repetition)
  FILE.jsonl         one object a line: "prompt", optional "output_len", "lane", "priority"

Before any text is drawn, ``fit_context`` caps synthetic prompts that would not fit the
model's context with their output (and skips file prompts that do not), with a notice.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from tqdm import tqdm

from expresslane.bench.prompts import PromptMaker
from expresslane.config.bench import DatasetSpec

SYNTHETIC = ("random", "sharegpt-like", "mixed", "prefix-repetition")


@dataclass(frozen=True, slots=True)
class Shape:
    """A request before its prompt text is drawn (``text`` is set for file prompts)."""

    input_len: int
    output_len: int
    length_class: str = "short"
    lane: str | None = None
    priority: int | None = None
    prefix: int | None = None  # index of the shared prefix (prefix-repetition)
    text: str | None = None


@dataclass(slots=True)
class SampleRequest:
    prompt: str
    prompt_len: int  # tokens as the server counts them (estimated without a tokenizer)
    output_len: int
    length_class: str = "short"
    lane: str | None = None
    priority: int | None = None


def uniform_lengths(rng: np.random.Generator, length: int, range_ratio: float,
                    n: int) -> np.ndarray:
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    lo = max(1, int(length * (1 - range_ratio)))
    hi = max(lo, int(length * (1 + range_ratio)))
    return rng.integers(lo, hi + 1, n)


def lognormal_lengths(rng: np.random.Generator, median: int, sigma: float,
                      n: int) -> np.ndarray:
    lens = rng.lognormal(np.log(max(median, 1)), sigma, n)
    return np.clip(np.rint(lens), 4, 16 * max(median, 4)).astype(int)


def sample_shapes(spec: DatasetSpec) -> list[Shape]:
    """Every request's shape, deterministic for a given spec."""
    if spec.name not in SYNTHETIC:
        return load_jsonl(spec)
    rng = np.random.default_rng(spec.seed)
    n = 1000 if spec.num_prompts is None else spec.num_prompts
    if n < 1:
        raise ValueError(f"num_prompts must be >= 1, got {n}")
    outs = uniform_lengths(rng, spec.output_len, spec.range_ratio, n)
    classes: list[str | None] = [None] * n
    prefixes: list[int | None] = [None] * n
    if spec.name in ("random", "prefix-repetition"):
        ins = uniform_lengths(rng, spec.input_len, spec.range_ratio, n)
        if spec.name == "prefix-repetition":
            if spec.num_prefixes < 1 or not 0 < spec.prefix_len < ins.min():
                raise ValueError(f"prefix-repetition needs num_prefixes >= 1 and 0 < prefix_len "
                                 f"< every prompt's length ({ins.min()}), got "
                                 f"{spec.num_prefixes} and {spec.prefix_len}")
            prefixes = [i % spec.num_prefixes for i in range(n)]
    elif spec.name == "sharegpt-like":
        ins = lognormal_lengths(rng, spec.input_len, 1.0, n)
        outs = lognormal_lengths(rng, spec.output_len, 0.8, n)
    else:  # mixed: long prompts at random positions among the short ones
        if not 0.0 <= spec.long_fraction <= 1.0:
            raise ValueError(f"long_fraction must be in [0, 1], got {spec.long_fraction}")
        is_long = np.zeros(n, dtype=bool)
        is_long[: round(n * spec.long_fraction)] = True
        rng.shuffle(is_long)
        ins = np.where(is_long,
                       uniform_lengths(rng, spec.long_input_len, spec.range_ratio, n),
                       uniform_lengths(rng, spec.input_len, spec.range_ratio, n))
        classes = ["long" if x else "short" for x in is_long]
    return [shape(spec, int(ins[i]), int(outs[i]), classes[i], prefix=prefixes[i])
            for i in range(n)]


def shape(spec: DatasetSpec, input_len: int, output_len: int, length_class: str | None = None,
          lane: str | None = None, priority: int | None = None, prefix: int | None = None,
          text: str | None = None) -> Shape:
    if length_class is None:
        length_class = "long" if input_len > spec.long_threshold else "short"
    if lane is None and spec.class_lanes:
        lane = "batch" if length_class == "long" else "interactive"
    return Shape(input_len, output_len, length_class, lane, priority, prefix, text)


def load_jsonl(spec: DatasetSpec) -> list[Shape]:
    """File prompts; their ``input_len`` is a word count until ``count_file_prompts``."""
    path = Path(spec.name)
    if path.suffix != ".jsonl" or not path.is_file():
        raise ValueError(f"dataset must be one of {', '.join(SYNTHETIC)} or an existing "
                         f".jsonl file, got {spec.name!r}")
    shapes = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            prompt = row["prompt"]
            if not isinstance(prompt, str):
                raise TypeError("'prompt' is not a string")
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{path}:{lineno}: expected an object with a 'prompt' "
                             f"field ({e})") from None
        shapes.append(Shape(max(1, len(prompt.split())), int(row.get("output_len", spec.output_len)),
                            lane=row.get("lane"), priority=row.get("priority"), text=prompt))
        if spec.num_prompts is not None and len(shapes) == spec.num_prompts:
            break
    if not shapes:
        raise ValueError(f"{path}: no prompts")
    return shapes


async def count_file_prompts(spec: DatasetSpec, shapes: list[Shape], maker: PromptMaker) -> list[Shape]:
    """File prompts with their token counts (exact with a tokenizer) and length classes."""
    counts = await asyncio.gather(*(maker.count(s.text) for s in shapes))
    return [shape(spec, n, s.output_len, lane=s.lane, priority=s.priority, text=s.text)
            for s, n in zip(shapes, counts)]


def fit_context(shapes: list[Shape], max_model_len: int | None,
                overhead: int = 0) -> tuple[list[Shape], list[str]]:
    """Cap synthetic prompts (skip file prompts) whose prompt + output + ``overhead``
    (a chat template's tokens) exceed the model's context; and say so."""
    if max_model_len is None:
        return shapes, ["the server did not report its context length (max_model_len in "
                        "/v1/models): prompts are sent as they are"]
    kept, capped, skipped = [], 0, 0
    for s in shapes:
        room = max_model_len - s.output_len - overhead
        if s.input_len <= room:
            kept.append(s)
        elif s.text is not None or room < 1:
            skipped += 1
        else:
            capped += 1
            kept.append(replace(s, input_len=room))
    notices = []
    if capped:
        notices.append(f"{capped} of {len(shapes)} prompts were longer than the model's context "
                       f"({max_model_len} tokens) leaves beside their output: capped to fit")
    if skipped:
        notices.append(f"{skipped} of {len(shapes)} prompts cannot fit the model's context "
                       f"({max_model_len} tokens) with their output: skipped")
    if not kept:
        raise ValueError(f"no prompt fits the model's context of {max_model_len} tokens with its "
                         "output; lower --input-len / --output-len")
    return kept, notices


async def draw_prompts(shapes: list[Shape], maker: PromptMaker, seed: int,
                       salt: int, prefix_len: int = 0, progress: bool = False) -> list[SampleRequest]:
    """Fresh text for every shape: a different ``salt`` gives different prompts. With
    ``progress``, a bar counts them (exact lengths take a few tokenizer calls each)."""
    rng = np.random.default_rng([seed, salt, 1])
    prefixes = {}
    for k in sorted({s.prefix for s in shapes if s.prefix is not None}):
        # The shared prefixes depend on the seed only: every salt shares the same ones.
        prefixes[k], _ = await maker.prompt(np.random.default_rng([seed, k, 2]), prefix_len)
    rngs = [np.random.default_rng(rng.integers(2**63)) for _ in shapes]  # order-independent draws

    bar = tqdm(total=len(shapes), disable=not progress, unit="prompt", desc="prompts")

    async def one(s: Shape, r: np.random.Generator) -> SampleRequest:
        if s.text is not None:
            text, n = s.text, s.input_len
        else:
            text, n = await maker.prompt(r, s.input_len, prefixes.get(s.prefix, ""))
        bar.update(1)
        return SampleRequest(text, n, s.output_len, s.length_class, s.lane, s.priority)

    requests = list(await asyncio.gather(*(one(s, r) for s, r in zip(shapes, rngs))))
    bar.close()
    return requests
