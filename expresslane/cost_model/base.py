"""A step's predicted time from what it computes (torch-free)."""

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
        """From (cached tokens, tokens now) per sequence; one token is a decode."""
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

    def plus_chunk(self, start: int, n: int, count: int = 1) -> "StepShape":
        """With `count` chunks of `n` tokens, each after `start` cached ones."""
        if n <= 0 or count <= 0:
            return self
        return StepShape(self.num_tokens + count * n, self.decode_context,
                         self.prefill_pairs + count * (n * start + n * (n + 1) // 2), True)


class StepCostModel(ABC):
    @abstractmethod
    def predict(self, shape: StepShape) -> float: ...

    @abstractmethod
    def observe(self, shape: StepShape, seconds: float) -> None:
        """A step the engine timed (a fixed model ignores it)."""

    @abstractmethod
    def to_dict(self) -> dict:
        """Plain data (GET /load publishes it)."""

    @abstractmethod
    def describe(self) -> str: ...

    def max_chunk(self, base: StepShape, start: int, limit: int, target: float) -> int:
        """The longest chunk (<= limit) after ``start`` cached tokens that keeps ``base`` within ``target`` s."""
        lo, hi = 0, max(0, limit)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.predict(base.plus_chunk(start, mid)) <= target:
                lo = mid
            else:
                hi = mid - 1
        return lo
