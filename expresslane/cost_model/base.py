"""Step-cost model: how long a step takes, from what it computes (torch-free). The engine is handed
one (`cost_model/registry.py`); the deadline policy sizes steps with it, speculative decoding
weighs verify steps with it, and the engine core refines it with each step it times.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StepShape:
    num_tokens: int  # every token the step computes
    decode_context: int = 0  # sum of the decodes' context lengths (KV tokens read)
    prefill_pairs: int = 0  # query-key pairs of the prefill chunks
    has_prefill: bool = False

    @classmethod
    def of(cls, chunks: Iterable[tuple[int, int]]) -> "StepShape":
        """From (tokens already cached, tokens computed now) per sequence; one token is a decode."""
        tokens = context = pairs = 0
        prefill = False
        for start, n in chunks:
            tokens += n
            if n == 1:
                context += start + 1
            else:
                prefill = True
                pairs += n * start + n * (n + 1) // 2
        return cls(tokens, context, pairs, prefill)

    def plus_chunk(self, start: int, n: int) -> "StepShape":
        """This step with one more prefill chunk of ``n`` tokens after ``start`` cached ones."""
        if n <= 0:
            return self
        return StepShape(self.num_tokens + n, self.decode_context,
                         self.prefill_pairs + n * start + n * (n + 1) // 2, True)


class StepCostModel(ABC):
    @abstractmethod
    def predict(self, shape: StepShape) -> float:
        """Predicted seconds of a step of this shape."""

    @abstractmethod
    def observe(self, shape: StepShape, seconds: float) -> None:
        """A step the engine ran and timed (a fixed model ignores it)."""

    @abstractmethod
    def to_dict(self) -> dict:
        """The model as plain data (the engine publishes it; a router predicts with it)."""

    @abstractmethod
    def describe(self) -> str:
        """One line for the start-up log."""

    def max_chunk(self, base: StepShape, start: int, limit: int, target: float) -> int:
        """The most prefill tokens (<= limit) a chunk starting after ``start`` cached tokens may
        add to ``base`` with the step predicted within ``target`` seconds (0 if none fits).
        Binary search: the prediction grows with the chunk."""
        lo, hi = 0, max(0, limit)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.predict(base.plus_chunk(start, mid)) <= target:
                lo = mid
            else:
                hi = mid - 1
        return lo
