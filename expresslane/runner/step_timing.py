"""Calibrating the step-cost model: synthetic steps timed through ``ModelRunner.execute`` at
start-up."""

from __future__ import annotations

import time

import torch

from expresslane.cost_model.base import StepShape
from expresslane.cost_model.piecewise import DEFAULT_KNOTS
from expresslane.contract import NewRequest, ScheduledSeq, StepPlan
from expresslane.sampling_params import SamplingParams

_GREEDY = SamplingParams(temperature=0.0, max_tokens=1)


def calibration_steps(budget: int, max_seqs: int, num_blocks: int, block_size: int,
                      max_model_len: int, light: bool = False) -> list[list[tuple[int, int]]]:
    """Steps as lists of (cached tokens, computed tokens); `light`: a few small ones."""
    capacity = num_blocks * block_size
    longest = max_model_len - 1
    top, batches, far, chunks = (256, (1, 8), 256, (64,)) if light else (8192, (1, 8, 32, 128), 4096, (64, 256, 1024))

    def fits(step: list[tuple[int, int]]) -> bool:
        blocks = sum(-(-(s + n) // block_size) for s, n in step)
        return (sum(n for _, n in step) <= budget and len(step) <= max_seqs and blocks <= num_blocks
                and all(s >= 0 and s + n <= longest for s, n in step))

    steps = [[(0, 1)]] + [[(0, n)] for n in DEFAULT_KNOTS if 1 < n <= min(budget, longest, top)]
    for batch in batches:
        for context in (16, min(far, longest - 1, capacity // batch - 2 * block_size)):
            steps.append([(context, 1)] * batch)
    decodes = [(min(far, 256), 1)] * min(16, max_seqs - 1)
    for n in chunks:
        for start in (0, min(far, longest - n - 1)):
            steps.append(decodes + [(start, n)])
    return [s for s in steps if s and fits(s)]


def _run(runner, step: list[tuple[int, int]], block_size: int) -> None:
    """Its requests released after."""
    seqs, next_block = [], 0
    for i, (start, n) in enumerate(step):
        nblocks = -(-(start + n) // block_size)
        seqs.append(ScheduledSeq(f"calibrate-{i}", [0] * n, start,
                                 list(range(next_block, next_block + nblocks)) * len(runner.kv_groups), True))
        next_block += nblocks
    ids = [s.request_id for s in seqs]
    runner.execute(StepPlan(-1, seqs, sum(n for _, n in step), [NewRequest(rid, _GREEDY) for rid in ids])).get()
    runner.release(ids)


@torch.inference_mode()
def time_steps(runner, steps: list[list[tuple[int, int]]], repeats: int = 1) -> list[tuple[StepShape, float]]:
    """The fastest of `repeats` runs of each step, after a warm-up."""
    cuda = runner.device.type == "cuda"
    samples = []
    for step in steps:
        _run(runner, step, runner.block_size)
        best = float("inf")
        for _ in range(repeats):
            if cuda:
                torch.cuda.synchronize(runner.device)
            t0 = time.perf_counter()
            _run(runner, step, runner.block_size)
            best = min(best, time.perf_counter() - t0)
        samples.append((StepShape.of(step), best))
    return samples
