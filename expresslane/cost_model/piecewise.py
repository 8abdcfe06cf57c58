"""t = L(num_tokens) + k_decode * decode_context + k_prefill * prefill_pairs, L piecewise linear
with a curve for steps with prefill and one for decodes alone (docs/architecture.md, "Step-cost model")."""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterable

import numpy as np

from expresslane.cost_model.base import StepCostModel, StepShape

DEFAULT_KNOTS = (1, 16, 32, 64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 4096, 8192)


def padded_tokens(shape: StepShape, padded: tuple[int, ...]) -> int:
    """A step with prefill runs padded to the smallest of `padded` that holds it."""
    if shape.has_prefill and padded and shape.num_tokens <= padded[-1]:
        return padded[bisect.bisect_left(padded, shape.num_tokens)]
    return shape.num_tokens


def _features(shapes: list[StepShape], knots: np.ndarray, padded: tuple[int, ...] = ()) -> np.ndarray:
    """Rows of [mixed hats(T), decode hats(T), decode_context, prefill_pairs]."""
    t = np.array([padded_tokens(s, padded) for s in shapes], dtype=np.float64)
    hats = np.zeros((len(shapes), len(knots)))
    # interpolation weights; past the last knot, its last segment
    idx = np.clip(np.searchsorted(knots, t, side="right") - 1, 0, len(knots) - 2)
    lo, hi = knots[idx], knots[idx + 1]
    w = (t - lo) / (hi - lo)
    rows = np.arange(len(shapes))
    hats[rows, idx] = 1.0 - w
    hats[rows, idx + 1] += w
    mixed = np.array([s.has_prefill for s in shapes], dtype=np.float64)[:, None]
    extra = np.array([[s.decode_context, s.prefill_pairs] for s in shapes]).reshape(len(shapes), 2)
    return np.hstack([hats * mixed, hats * (1.0 - mixed), extra])


def _design(samples: list[tuple[StepShape, float]], knots: np.ndarray,
            padded: tuple[int, ...] = ()) -> tuple[np.ndarray, np.ndarray]:
    return (_features([s for s, _ in samples], knots, padded),
            np.array([t for _, t in samples], dtype=np.float64))


Params = tuple[np.ndarray, np.ndarray, float, float]  # (token_times, decode_times, k_decode, k_prefill)


def _error(x: np.ndarray, y: np.ndarray, params: Params) -> float:
    """Mean relative error of the predictions, in one product (it runs in the step loop)."""
    token_times, decode_times, *attention = params
    predicted = np.maximum(x @ np.concatenate([token_times, decode_times, attention]), 0.0)
    return float(np.mean(np.abs(predicted - y) / y))


class PiecewiseStepCostModel(StepCostModel):
    """Fitted, or by hand: one curve (`decode_times` None) and the mixed path's constant `c_mixed`."""

    def __init__(self, knots: Iterable[int], token_times: Iterable[float], k_decode: float = 0.0,
                 k_prefill: float = 0.0, c_mixed: float = 0.0, padded: Iterable[int] = (),
                 decode_times: Iterable[float] | None = None):
        self.knots = np.array(sorted(knots), dtype=np.float64)
        if len(self.knots) < 2:
            raise ValueError("a step-cost model needs at least two token-count knots")
        times = np.array(list(token_times), dtype=np.float64)
        self.token_times = times + c_mixed  # steps with prefill (the mixed path)
        self.decode_times = times.copy() if decode_times is None else np.array(list(decode_times), dtype=np.float64)
        self.k_decode, self.k_prefill = k_decode, k_prefill
        self.padded = tuple(sorted(padded))  # the mixed graphs' buckets
        self._calibration: list[tuple[StepShape, float]] = []
        self._recent: deque[tuple[StepShape, float]] = deque(maxlen=512)
        self._since_fit = 0
        self.refit_every = 256  # 0: never (a fixed model)
        self.refits = 0  # refits kept

    # -- fitting -----------------------------------------------------------------------
    @classmethod
    def fit(cls, samples: list[tuple[StepShape, float]], max_tokens: int | None = None,
            padded: Iterable[int] = ()) -> "PiecewiseStepCostModel":
        """Least squares; knots: the default ones within the sampled range, and the buckets."""
        if not samples:
            raise ValueError("no samples to fit a step-cost model")
        top = max(max_tokens or 0, 2, max(s.num_tokens for s, _ in samples))
        knots = sorted({k for k in DEFAULT_KNOTS if k < top} | {p for p in padded if p < top} | {top})
        model = cls(knots, np.zeros(len(knots)), padded=padded)
        model._calibration = list(samples)
        model._set(model._solve(*_design(model._calibration, model.knots, model.padded)))
        return model

    @property
    def params(self) -> Params:
        return self.token_times, self.decode_times, self.k_decode, self.k_prefill

    def _set(self, params: Params) -> None:
        self.token_times, self.decode_times, self.k_decode, self.k_prefill = params

    def _refit(self) -> None:
        """On calibration + recent samples, kept only if it predicts them better."""
        self._since_fit = 0
        x, y = _design(self._calibration + list(self._recent), self.knots, self.padded)
        new = self._solve(x, y)
        if _error(x, y, new) <= _error(x, y, self.params):
            self._set(new)
            self.refits += 1

    def _solve(self, x: np.ndarray, y: np.ndarray) -> Params:
        n = len(self.knots)
        attention = (2 * n, 2 * n + 1)
        keep = list(range(2 * n + 2))
        while True:
            coef = np.zeros(2 * n + 2)
            sol, *_ = np.linalg.lstsq(x[:, keep], y, rcond=None)
            coef[keep] = sol
            negative = [j for j in attention if j in keep and coef[j] < 0]
            if not negative:  # a negative attention term is dropped and the rest refitted
                break
            keep.remove(negative[0])
        covered = np.abs(x[:, :2 * n]).sum(axis=0) > 0
        mixed = self._curve(coef[:n], covered[:n]) if covered[:n].any() else None
        decode = self._curve(coef[n:2 * n], covered[n:2 * n], mixed)
        return (decode.copy() if mixed is None else mixed), decode, float(coef[2 * n]), float(coef[2 * n + 1])

    def _curve(self, times: np.ndarray, covered: np.ndarray, beside: np.ndarray | None = None) -> np.ndarray:
        """A curve at every knot from those its samples reach: interpolated between them, past the
        last parallel to `beside` or its last segment; non-decreasing."""
        if not covered.any():
            return beside.copy()
        k, t = self.knots[covered], times[covered]
        out = np.interp(self.knots, k, t)
        above = self.knots > k[-1]
        if beside is not None:
            out[above] = beside[above] + t[-1] - np.interp(k[-1], self.knots, beside)
        elif len(k) >= 2:
            slope = max((t[-1] - t[-2]) / (k[-1] - k[-2]), 0.0)
            out[above] = t[-1] + slope * (self.knots[above] - k[-1])
        return np.maximum.accumulate(np.maximum(out, 0.0))

    @property
    def num_observed(self) -> int:
        return len(self._recent)

    def observe(self, shape: StepShape, seconds: float) -> None:
        if seconds <= 0 or shape.num_tokens <= 0:
            return
        self._recent.append((shape, seconds))
        self._since_fit += 1
        if self.refit_every and self._since_fit >= self.refit_every:
            self._refit()

    # -- use -----------------------------------------------------------------------------
    def linear(self, shape: StepShape) -> float:
        times = self.token_times if shape.has_prefill else self.decode_times
        t = float(padded_tokens(shape, self.padded))
        k = self.knots
        if t >= k[-1]:  # past the last knot: its last segment
            return float(times[-1] + (times[-1] - times[-2]) / (k[-1] - k[-2]) * (t - k[-1]))
        return float(np.interp(t, k, times))

    def predict(self, shape: StepShape) -> float:
        if shape.num_tokens <= 0:
            return 0.0
        return max(0.0, self.linear(shape) + self.k_decode * shape.decode_context
                   + self.k_prefill * shape.prefill_pairs)

    def to_dict(self) -> dict:
        return {"knots": self.knots.tolist(), "token_times": self.token_times.tolist(),
                "decode_times": self.decode_times.tolist(), "k_decode": self.k_decode, "k_prefill": self.k_prefill,
                "padded": list(self.padded)}

    @classmethod
    def from_dict(cls, d: dict) -> "PiecewiseStepCostModel":
        """From `to_dict`'s data, or an older model's (one curve and `c_mixed`)."""
        return cls(d["knots"], d["token_times"], d["k_decode"], d["k_prefill"], d.get("c_mixed", 0.0),
                   d.get("padded", ()), d.get("decode_times"))

    def describe(self) -> str:
        top = self.knots[-1]

        def at(sizes, prefill: bool) -> str:
            return ", ".join(f"{n} {self.predict(StepShape(n, has_prefill=prefill)) * 1e3:.2f}"
                             for n in sizes if n <= top)
        return (f"decodes alone (seqs: ms) {at((1, 8, 64, 256), False)}; steps with prefill (tokens: ms) "
                f"{at((64, 128, 256, 512, 2048), True)}; +{self.k_decode * 1e9:.2f} ns per decode context token, "
                f"+{self.k_prefill * 1e9:.4f} ns per prefill query-key pair "
                f"({len(self._calibration)} calibration samples)")


class NominalStepCostModel(PiecewiseStepCostModel):
    """Fixed, by shape alone (tests, Triton's interpreter): 1 ms a step, 10 us a token, 10 ns a
    decode context token, 1 ns a prefill query-key pair."""

    def __init__(self, max_tokens: int):
        top = max(max_tokens, 2)
        super().__init__([1, top], [1e-3 + 1e-5, 1e-3 + 1e-5 * top], k_decode=1e-8, k_prefill=1e-9)
        self.refit_every = 0

    def observe(self, shape: StepShape, seconds: float) -> None:
        pass
