"""Benchmark prompts without downloads: synthetic word prompts or a JSONL file.

Synthetic prompts are random common English words. Each such word is one token in
the usual BPE vocabularies (GPT-2, Llama, Qwen), so ``n`` words ~ ``n`` tokens; the
client can sharpen this with the server's ``/tokenize`` (``tokens_per_word``), and
the server's usage report gives the exact count afterwards.

Datasets:
  random         input/output lengths uniform in len*(1-r)..len*(1+r) (vLLM's random)
  sharegpt-like  log-normal lengths shaped like chat logs: median at the given
                 lengths, long right tail (sigma 1.0 input, 0.8 output), clipped
  mixed          the flat-latency mix: a fraction of long prompts among short ones
  FILE.jsonl     one object a line: "prompt", optional "output_len", "lane", "priority"
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SYNTHETIC = ("random", "sharegpt-like", "mixed")

_WORDS = np.array("""
time people year way day man thing woman life child world school state family
student group country problem hand part place case week company system program
question work government number night point home water room mother area money
story fact month lot right study book eye job word business issue side kind head
house service friend father power hour game line end member law car city name
team minute idea kid body information back parent face others level office door
health person art war history party result change morning reason research girl
guy moment air teacher force education light river green small large open""".split())


@dataclass(frozen=True, slots=True)
class DatasetSpec:
    name: str = "random"  # one of SYNTHETIC, or a path to a .jsonl file
    num_prompts: int | None = None  # None: 1000 synthetic, or every line of the file
    input_len: int = 1024
    output_len: int = 128
    range_ratio: float = 0.0
    long_fraction: float = 0.2  # mixed: share of long prompts
    long_input_len: int = 4096  # mixed: length of the long prompts
    long_threshold: int = 1024  # prompts longer than this are class "long"
    class_lanes: bool = False  # send lane=interactive for short, lane=batch for long
    seed: int = 0


@dataclass(slots=True)
class SampleRequest:
    prompt: str
    prompt_len: int  # estimated tokens; the server's usage overrides it when reported
    output_len: int
    length_class: str = "short"
    lane: str | None = None
    priority: int | None = None


def word_prompt(rng: np.random.Generator, num_tokens: int, tokens_per_word: float) -> str:
    n_words = max(1, round(num_tokens / tokens_per_word))
    return " ".join(_WORDS[rng.integers(0, len(_WORDS), n_words)])


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


def sample_requests(spec: DatasetSpec, tokens_per_word: float = 1.0) -> list[SampleRequest]:
    """Build the benchmark's requests, deterministic for a given spec and ratio."""
    if spec.name not in SYNTHETIC:
        return load_jsonl(spec, tokens_per_word)
    rng = np.random.default_rng(spec.seed)
    n = 1000 if spec.num_prompts is None else spec.num_prompts
    if n < 1:
        raise ValueError(f"num_prompts must be >= 1, got {n}")
    outs = uniform_lengths(rng, spec.output_len, spec.range_ratio, n)
    classes: list[str | None] = [None] * n
    if spec.name == "random":
        ins = uniform_lengths(rng, spec.input_len, spec.range_ratio, n)
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
    requests = []
    for i in range(n):
        prompt = word_prompt(rng, int(ins[i]), tokens_per_word)
        requests.append(make_request(spec, prompt, int(ins[i]), int(outs[i]), classes[i]))
    return requests


def make_request(spec: DatasetSpec, prompt: str, prompt_len: int, output_len: int,
                 length_class: str | None = None, lane: str | None = None,
                 priority: int | None = None) -> SampleRequest:
    if length_class is None:
        length_class = "long" if prompt_len > spec.long_threshold else "short"
    if lane is None and spec.class_lanes:
        lane = "batch" if length_class == "long" else "interactive"
    return SampleRequest(prompt, prompt_len, output_len, length_class, lane, priority)


def load_jsonl(spec: DatasetSpec, tokens_per_word: float) -> list[SampleRequest]:
    path = Path(spec.name)
    if path.suffix != ".jsonl" or not path.is_file():
        raise ValueError(f"dataset must be one of {', '.join(SYNTHETIC)} or an existing "
                         f".jsonl file, got {spec.name!r}")
    requests = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            prompt = row["prompt"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{path}:{lineno}: expected an object with a 'prompt' "
                             f"field ({e})") from None
        prompt_len = max(1, round(len(prompt.split()) * tokens_per_word))
        requests.append(make_request(
            spec, prompt, prompt_len, int(row.get("output_len", spec.output_len)),
            lane=row.get("lane"), priority=row.get("priority")))
        if spec.num_prompts is not None and len(requests) == spec.num_prompts:
            break
    if not requests:
        raise ValueError(f"{path}: no prompts")
    return requests
