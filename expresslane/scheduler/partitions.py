"""SMs for the decode and prefill lanes (docs/architecture.md, "Prefill and decode side by side")."""

from __future__ import annotations

from dataclasses import dataclass

from expresslane.cost_model.base import StepCostModel, StepShape


@dataclass(frozen=True, slots=True)
class Split:
    decode_sms: int
    prefill_sms: int
    decode_factor: float = 1.0  # time here / on every SM
    prefill_factor: float = 1.0

    @property
    def shared_sms(self) -> int:  # 0: a lane alone
        return self.decode_sms if self.decode_sms and self.prefill_sms else 0


@dataclass(frozen=True, slots=True)
class SplitCurve:
    """(decode SMs, its factor, the prefill's factor) per split."""

    total_sms: int
    points: tuple[tuple[int, float, float], ...]

    def splits(self) -> list[Split]:
        return [Split(n, self.total_sms - n, d, p) for n, d, p in sorted(self.points)]

    def only(self, decode_sms: tuple[int, ...]) -> SplitCurve:
        return SplitCurve(self.total_sms, tuple(p for p in self.points if p[0] in decode_sms))


# docs/performance.md, "How many SMs a decode needs"
H100_CURVE = SplitCurve(132, ((8, 5.33, 1.04), (16, 2.86, 1.09), (24, 2.03, 1.13), (32, 1.76, 1.19),
                              (40, 1.49, 1.25), (48, 1.45, 1.32), (64, 1.30, 1.50), (80, 1.34, 1.89),
                              (96, 1.28, 2.70), (112, 1.18, 4.83)))


# graphs are captured per split
LANE_SPLITS = H100_CURVE.only((40, 64))


class SplitPolicy:
    """Fewest decode SMs within `target()`, else within `knee` of the best; a lone lane gets all."""

    def __init__(self, cost_model: StepCostModel, tpot: float, itl_ratio: float = 1.5,
                 curve: SplitCurve = LANE_SPLITS, knee: float = 1.1):
        self.cost_model, self.tpot, self.itl_ratio, self.knee = cost_model, tpot, itl_ratio, knee
        self.total_sms = curve.total_sms
        self._splits = curve.splits()

    def decode_sms(self) -> list[int]:
        return [s.decode_sms for s in self._splits]

    def whole(self, decode: bool) -> Split:
        n = self.total_sms
        return Split(n, 0) if decode else Split(0, n)

    def target(self) -> float:
        """`itl_ratio` x a lone decode step, at most TPOT."""
        return min(self.tpot, self.itl_ratio * self.cost_model.predict(StepShape(1, 1)))

    def choose(self, decodes: StepShape, prefill: bool) -> Split:
        if not prefill or not decodes.num_tokens:
            return self.whole(decode=not prefill)
        alone, target = self.cost_model.predict(decodes), self.target()
        for split in self._splits:
            if alone * split.decode_factor <= target:
                return split
        best = min(s.decode_factor for s in self._splits)
        return next(s for s in self._splits if s.decode_factor <= self.knee * best)
