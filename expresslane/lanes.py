"""Lanes: classes of requests with their own latency targets (torch-free).

A request runs in the ``interactive`` lane (the default) or the ``batch`` lane; one
without an explicit lane picks it by priority (<= 0 interactive, > 0 batch). Each lane
has SLO targets and a share of every step's token budget: while interactive work is
waiting or running, the batch lane takes only its share of a step (the steps that
carry interactive tokens stay short) and interactive work never takes it away. Under
the ``deadline`` policy a request's rank is its TTFT deadline (arrival + its lane's
TTFT target), so interactive work goes first without starving old batch work, and a
waiting interactive request may preempt running batch requests when blocks or seats
run out (scheduler/policy.py).

Spec (``--lane-slo``): ``interactive:ttft=200ms,tpot=25ms,slack=1.0;batch:ttft=30s,share=0.25,queue=64``
(``queue``: the server refuses new requests of a lane with that many already waiting;
``slack``: how much longer than a lone decode's step a prefill chunk may make a step, see
scheduler/policy.py).
The spec is parsed once, into ``Lanes``, when the config is built (``SchedulerConfig``);
the scheduler and the server read the typed value.
"""

from __future__ import annotations

from dataclasses import dataclass

LANES = ("interactive", "batch")


@dataclass(frozen=True, slots=True)
class LaneSLO:
    ttft: float  # seconds
    tpot: float  # seconds
    share: float  # batch: its fraction of a step while interactive work is on (interactive: unused)
    queue: int = 0  # the server's cap on this lane's waiting requests (0 = none; over it: 503)
    # interactive: how much longer than a lone decode's step a step may be made by the prefill it
    # carries (1.0: twice as long; or its decodes' own step, if longer), by the step-cost model;
    # the `tpot` target bounds it in any case
    slack: float = 0.0


DEFAULT_LANE_SLO = "interactive:ttft=200ms,tpot=25ms,slack=1.0;batch:ttft=30s,tpot=500ms,share=0.25"


def resolve_lane(lane: str | None, priority: int) -> str:
    if lane is None:
        return "interactive" if priority <= 0 else "batch"
    if lane not in LANES:
        raise ValueError(f"lane must be one of {', '.join(LANES)}, got {lane!r}")
    return lane


def _seconds(text: str, where: str) -> float:
    for suffix, scale in (("ms", 1e-3), ("s", 1.0)):
        if text.endswith(suffix):
            try:
                return float(text[:-len(suffix)]) * scale
            except ValueError:
                break
    raise ValueError(f"{where}: expected a duration like 200ms or 2s, got {text!r}")


@dataclass(frozen=True, slots=True)
class Lanes:
    """Every lane's targets and share (read like a mapping: ``lanes["batch"].share``)."""

    interactive: LaneSLO
    batch: LaneSLO

    @classmethod
    def parse(cls, spec: str) -> "Lanes":
        """A lane spec laid over the defaults, key by key; unknown lanes or keys are errors."""
        values: dict[str, dict[str, float]] = {lane: {"share": 0.0, "queue": 0} for lane in LANES}
        for layer in (_parse(DEFAULT_LANE_SLO), _parse(spec)):
            for lane, given in layer.items():
                values[lane].update(given)
        return cls(**{lane: LaneSLO(**v) for lane, v in values.items()})

    def __getitem__(self, lane: str) -> LaneSLO:
        return getattr(self, lane)

    def items(self) -> list[tuple[str, LaneSLO]]:
        return [(lane, self[lane]) for lane in LANES]


def _parse(spec: str) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        lane, _, items = part.partition(":")
        if lane not in LANES:
            raise ValueError(f"lane_slo: unknown lane {lane!r} (lanes: {', '.join(LANES)})")
        given = out.setdefault(lane, {})
        for item in filter(None, (i.strip() for i in items.split(","))):
            key, _, value = item.partition("=")
            if key in ("ttft", "tpot"):
                given[key] = _seconds(value, f"lane_slo {lane}.{key}")
            elif key == "queue":
                if not value.isdigit():
                    raise ValueError(f"lane_slo {lane}.queue must be a whole number, got {value!r}")
                given[key] = int(value)
            elif key in ("share", "slack"):
                try:
                    given[key] = float(value)
                except ValueError:
                    given[key] = -1.0
                top = 1.0 if key == "share" else 10.0
                if not 0.0 <= given[key] <= top:
                    raise ValueError(f"lane_slo {lane}.{key} must be in [0, {top:g}], got {value!r}")
            else:
                raise ValueError(f"lane_slo: unknown key {key!r} for lane {lane} "
                                 "(keys: ttft, tpot, share, slack, queue)")
    return out
