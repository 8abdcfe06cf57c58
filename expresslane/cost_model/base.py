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

    def plus_chunk(self, start: int, n: int) -> "StepShape":
        if n <= 0:
            return self
        return StepShape(self.num_tokens + n, self.decode_context,
                         self.prefill_pairs + n * start + n * (n + 1) // 2, True)


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

    def step_sizes(self, top: int) -> list[int]:
        """Step sizes (tokens) below ``top`` where the cost per token may turn: powers of two."""
        return [1 << i for i in range(top.bit_length()) if 1 << i < top]

    def knee(self, base: StepShape, start: int, limit: int, within: float) -> int:
        """The smallest chunk (<= limit) after ``start`` cached tokens whose step, less the chunk's own
        attention, costs per token at most the least any chunk size reaches plus ``within`` times a
        token's cost here (that least plus attending to ``start`` keys). How a prompt is cut moves
        none of its query-key pairs, so a lone prompt cut at the knee costs at most ``1 + within``
        times what it costs cut any other way, its last chunk aside."""
        if limit <= 1:
            return max(0, limit)

        def per_token(n: int, pairs: int = 0) -> float:
            shape = StepShape(base.num_tokens + n, base.decode_context, base.prefill_pairs + pairs, True)
            return self.predict(shape) / shape.num_tokens
        sizes = sorted({n - base.num_tokens for n in self.step_sizes(base.num_tokens + limit)
                        if n > base.num_tokens} | {limit})
        costs = [per_token(n) for n in sizes]
        best = sizes[costs.index(min(costs))]
        bar = min(costs) + within * per_token(best, best * start)
        i = next(i for i, c in enumerate(costs) if c <= bar)
        lo, hi = (sizes[i - 1] if i else 0), sizes[i]
        while hi - lo > 1:  # the smallest within the bar between two sizes (hi always within it)
            mid = (lo + hi) // 2
            if per_token(mid) <= bar:
                hi = mid
            else:
                lo = mid
        return hi
