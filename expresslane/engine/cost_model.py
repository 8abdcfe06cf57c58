"""Step-cost model: how long a step takes, from what it computes (torch-free).

A step's time, fitted on the engine's own hardware:

    t = L(num_tokens) + k_decode * decode_context + k_prefill * prefill_pairs + c_mixed * has_prefill

- ``L`` is piecewise linear over token-count knots: the linear layers. Flat while the
  step is memory-bound (reading the weights dominates), steep once it is compute-bound;
  where the bend lies is the hardware's, so it is measured, not assumed.
- ``decode_context``: KV tokens read by the step's decodes (memory-bound attention).
- ``prefill_pairs``: query-key pairs of its prefill chunks (compute-bound attention);
  a chunk of ``n`` tokens after ``s`` cached ones has ``n * (s + (n + 1) / 2)``.
- ``has_prefill``: a step with a prefill chunk runs another path (mixed graphs) than a
  pure-decode step (decode graphs); the difference is a constant.
- ``padded``: the token counts that path computes (its graphs' buckets). A step with prefill
  costs what its bucket costs: on the H200 one decode beside a 136- or a 200-token chunk took
  the same 8.7 ms (bucket 256), where interpolating 137 tokens between knots said 7.6 ms. So
  ``num_tokens`` is read as its bucket in fitting and predicting alike, and the largest chunk
  within a target fills its bucket (``max_chunk``).

Calibration samples come from synthetic steps timed at start-up (``runner/step_timing``);
``observe`` adds the steps the engine actually ran and refits every ``refit_every``
observations, so the model follows what the machine does under load (host overheads
included: that cadence is what a request's inter-token latency is made of). A refit is
kept only if it predicts the samples (calibration and recent) better than the model in
use: recent steps cluster on a few shapes, and a least-squares fit on them can bend the
knots they do not reach (on the H200, one such fit predicted 41 ms for 12 ms steps and
the scheduler then cut every prompt into 16-token chunks).
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

DEFAULT_KNOTS = (1, 16, 32, 64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 4096, 8192)


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


def padded_tokens(shape: StepShape, padded: tuple[int, ...]) -> int:
    """The tokens the step computes: a step with prefill is padded to the smallest of `padded`
    that holds it (none past the largest: those run unpadded)."""
    if shape.has_prefill and padded and shape.num_tokens <= padded[-1]:
        return padded[bisect.bisect_left(padded, shape.num_tokens)]
    return shape.num_tokens


def _features(shapes: list[StepShape], knots: np.ndarray, padded: tuple[int, ...] = ()) -> np.ndarray:
    """Rows of [hat_0(T) .. hat_k(T), decode_context, prefill_pairs, has_prefill], T padded."""
    t = np.array([padded_tokens(s, padded) for s in shapes], dtype=np.float64)
    hats = np.zeros((len(shapes), len(knots)))
    # piecewise-linear interpolation weights; past the last knot, extrapolate its last segment
    idx = np.clip(np.searchsorted(knots, t, side="right") - 1, 0, len(knots) - 2)
    lo, hi = knots[idx], knots[idx + 1]
    w = (t - lo) / (hi - lo)
    rows = np.arange(len(shapes))
    hats[rows, idx] = 1.0 - w
    hats[rows, idx + 1] += w
    extra = np.array([[s.decode_context, s.prefill_pairs, float(s.has_prefill)] for s in shapes])
    return np.hstack([hats, extra.reshape(len(shapes), 3)])


def _design(samples: list[tuple[StepShape, float]], knots: np.ndarray,
            padded: tuple[int, ...] = ()) -> tuple[np.ndarray, np.ndarray]:
    """(features, seconds) of the samples."""
    return (_features([s for s, _ in samples], knots, padded),
            np.array([t for _, t in samples], dtype=np.float64))


def _error(x: np.ndarray, y: np.ndarray, params: tuple[np.ndarray, float, float, float]) -> float:
    """Mean relative error of a model's predictions over a design, in one product (the refit runs
    in the step loop): the features interpolate exactly as `predict` does, clamped at 0 alike."""
    token_times, *attention = params
    predicted = np.maximum(x @ np.concatenate([token_times, attention]), 0.0)
    return float(np.mean(np.abs(predicted - y) / y))


class StepCostModel:
    """Predicted seconds of a step; fit from (StepShape, seconds) samples."""

    def __init__(self, knots: Iterable[int], token_times: Iterable[float], k_decode: float = 0.0,
                 k_prefill: float = 0.0, c_mixed: float = 0.0, padded: Iterable[int] = ()):
        self.padded = tuple(sorted(padded))  # token counts a step with prefill is padded to
        self.knots = np.array(sorted(knots), dtype=np.float64)
        if len(self.knots) < 2:
            raise ValueError("a step-cost model needs at least two token-count knots")
        self.token_times = np.array(list(token_times), dtype=np.float64)
        self.k_decode, self.k_prefill, self.c_mixed = k_decode, k_prefill, c_mixed
        self._calibration: list[tuple[StepShape, float]] = []
        self._recent: deque[tuple[StepShape, float]] = deque(maxlen=512)
        self._since_fit = 0
        self.refit_every = 256
        self.refits = 0  # refits kept

    # -- fitting -----------------------------------------------------------------------
    @classmethod
    def fit(cls, samples: list[tuple[StepShape, float]], max_tokens: int | None = None,
            padded: Iterable[int] = ()) -> "StepCostModel":
        """Least squares over the samples; knots are the default ones within the sampled range
        and the `padded` sizes (the buckets' costs are the ones the steps pay)."""
        if not samples:
            raise ValueError("no samples to fit a step-cost model")
        top = max(max_tokens or 0, 2, max(s.num_tokens for s, _ in samples))
        knots = sorted({k for k in DEFAULT_KNOTS if k < top} | {p for p in padded if p < top} | {top})
        model = cls(knots, np.zeros(len(knots)), padded=padded)
        model._calibration = list(samples)
        model.token_times, model.k_decode, model.k_prefill, model.c_mixed = model._solve(
            *_design(model._calibration, model.knots, model.padded))
        return model

    @classmethod
    def nominal(cls, max_tokens: int) -> "StepCostModel":
        """A model by the step's shape alone, where timing says nothing of a device: Triton's
        interpreter on CPU (tests), whose steps take seconds of Python. 1 ms a step, 10 us a
        token, 10 ns per decode context token, 1 ns per prefill query-key pair."""
        top = max(max_tokens, 2)
        return cls([1, top], [1e-3 + 1e-5, 1e-3 + 1e-5 * top], k_decode=1e-8, k_prefill=1e-9)

    def _refit(self) -> None:
        """Refit on calibration + recent samples; keep the result only if it predicts them better."""
        self._since_fit = 0
        x, y = _design(self._calibration + list(self._recent), self.knots, self.padded)
        new = self._solve(x, y)
        if _error(x, y, new) <= _error(x, y, (self.token_times, self.k_decode, self.k_prefill, self.c_mixed)):
            self.token_times, self.k_decode, self.k_prefill, self.c_mixed = new
            self.refits += 1

    def _solve(self, x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, float, float, float]:
        """Least squares over the design (`_design`): (token_times, k_decode, k_prefill, c_mixed)."""
        n = len(self.knots)
        keep = list(range(n + 3))
        while True:
            coef = np.zeros(n + 3)
            sol, *_ = np.linalg.lstsq(x[:, keep], y, rcond=None)
            coef[keep] = sol
            negative = [j for j in (n, n + 1) if j in keep and coef[j] < 0]
            if not negative:  # attention costs are never negative; drop such a term and refit
                break
            keep.remove(negative[0])
        covered = np.abs(x[:, :n]).sum(axis=0) > 0
        times = coef[:n]
        if not covered.all():  # a knot no sample reaches: from its neighbours, or past the last
            k, t = self.knots[covered], times[covered]  # sampled one along the last sampled segment
            times = np.interp(self.knots, k, t)
            if len(k) >= 2:
                slope = max((t[-1] - t[-2]) / (k[-1] - k[-2]), 0.0)
                above = self.knots > k[-1]
                times[above] = t[-1] + slope * (self.knots[above] - k[-1])
        # more tokens never take less time: the linear part is non-decreasing
        k_decode, k_prefill, c_mixed = (float(c) for c in coef[n:])
        return np.maximum.accumulate(np.maximum(times, 0.0)), k_decode, k_prefill, c_mixed

    @property
    def num_observed(self) -> int:
        return len(self._recent)

    def observe(self, shape: StepShape, seconds: float) -> None:
        """A step the engine ran; refits every `refit_every` observations."""
        if seconds <= 0 or shape.num_tokens <= 0:
            return
        self._recent.append((shape, seconds))
        self._since_fit += 1
        if self._since_fit >= self.refit_every:
            self._refit()

    # -- use -----------------------------------------------------------------------------
    def predict(self, shape: StepShape) -> float:
        if shape.num_tokens <= 0:
            return 0.0
        t = float(padded_tokens(shape, self.padded))
        k = self.knots
        if t >= k[-1]:  # past the last knot: its last segment's slope
            slope = (self.token_times[-1] - self.token_times[-2]) / (k[-1] - k[-2])
            linear = self.token_times[-1] + slope * (t - k[-1])
        else:
            linear = float(np.interp(t, k, self.token_times))
        return max(0.0, float(linear) + self.k_decode * shape.decode_context + self.k_prefill * shape.prefill_pairs
                   + (self.c_mixed if shape.has_prefill else 0.0))

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

    def to_dict(self) -> dict:
        """The fitted model as plain data (the engine publishes it; a router predicts with it)."""
        return {"knots": self.knots.tolist(), "token_times": self.token_times.tolist(), "k_decode": self.k_decode,
                "k_prefill": self.k_prefill, "c_mixed": self.c_mixed, "padded": list(self.padded)}

    @classmethod
    def from_dict(cls, d: dict) -> "StepCostModel":
        return cls(d["knots"], d["token_times"], d["k_decode"], d["k_prefill"], d["c_mixed"], d.get("padded", ()))

    def describe(self) -> str:
        """One line for the start-up log: the linear part at a few sizes, and the attention terms."""
        sizes = [k for k in (1, 64, 128, 256, 512, 2048) if k <= self.knots[-1]]
        parts = ", ".join(f"{n} tok {self.predict(StepShape(n)) * 1e3:.2f} ms" for n in sizes)
        return (f"{parts}; +{self.k_decode * 1e9:.2f} ns per decode context token, "
                f"+{self.k_prefill * 1e9:.4f} ns per prefill query-key pair, "
                f"{self.c_mixed * 1e3:+.2f} ms for a step with prefill "
                f"({len(self._calibration)} calibration samples)")
