"""Pieces shared by the in-process benchmarks (one-batch, flat-latency).

Prompts are random token ids: no tokenizer in the timed path, exact lengths, and no
prefix-cache hits between prompts. Engine outputs become the same ``RequestRecord``
the HTTP client produces, so ``stats`` and the tables treat both alike.
"""

from __future__ import annotations

import gc
import random

import torch

from expresslane.bench.records import RequestRecord

# Engine settings of each in-process batching/policy mode, by the one name every
# benchmark uses: continuous = continuous batching with the fcfs policy; continuous-lanes
# = continuous batching with the deadline policy (lanes).
MODES = {
    "static": {"batching": "static", "scheduling_policy": "fcfs"},
    "dynamic": {"batching": "dynamic", "scheduling_policy": "fcfs"},
    "continuous": {"batching": "continuous", "scheduling_policy": "fcfs"},
    "continuous-lanes": {"batching": "continuous", "scheduling_policy": "deadline"},
}


def random_prompts(rng: random.Random, vocab_size: int, lengths: list[int]) -> list[list[int]]:
    """Random token ids, below 30000 (a real vocabulary keeps its special tokens above):
    every benchmark's in-process prompts. Draws never repeat a 16-token block in practice,
    so no prompt hits the prefix cache on another's."""
    high = min(vocab_size, 30000)
    return [[rng.randrange(high) for _ in range(n)] for n in lengths]


def record_from_output(out) -> RequestRecord:
    """A finished ``RequestOutput`` as a record; times are the engine's monotonic stamps.

    The engine keeps no per-token times, so ``itl`` stays empty (TPOT is still exact).
    """
    m = out.metrics
    return RequestRecord(
        input_len=len(out.prompt_token_ids), start=m.arrival_time, end=m.finished_time,
        success=True, output_len=sum(len(c.token_ids) for c in out.outputs),
        ttft=m.first_token_time - m.arrival_time, latency=m.finished_time - m.arrival_time)


def device_and_dtype(llm) -> tuple[torch.device, torch.dtype]:
    """Where an engine runs and its activations' dtype (its config holds them resolved)."""
    return torch.device(llm.config.device.device), getattr(torch, llm.config.model.dtype)


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work, so a wall-clock interval covers the work it started."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release_memory() -> None:
    """Free a dropped engine's memory before the next one sizes its KV cache from what is free."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
