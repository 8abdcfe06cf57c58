"""Admission: what the server lets in, counted in sequences and prompt tokens (pure, no I/O).

One HTTP request is ``prompts × n`` sequences, each with its prompt's tokens. A sequence
is *waiting* from admission until its first token (or its end); the caps bound the
waiting work, so a request of 300 prompts × n=128 counts 38,400 sequences, not one.

- A request that could never fit a cap on its own is refused with 400 (retrying cannot
  help); one that does not fit *now* gets 503 + ``Retry-After``.
- ``slo_ttft`` (``--slo-admission``): an interactive request is refused when the
  interactive prompt tokens waiting ahead of it, plus its own, cannot be processed
  within the lane's TTFT target at the rate the engine's steps have been processing
  tokens (a moving average of ``observe_step``). With nothing waiting it is admitted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from expresslane.server import errors


@dataclass(frozen=True, slots=True)
class AdmissionLimits:
    """Caps on waiting work; None = no cap."""

    max_waiting_requests: int | None = None  # sequences (prompts × n)
    max_waiting_tokens: int | None = None  # their prompt tokens
    slo_ttft: float | None = None  # seconds; SLO admission of interactive work
    lane_queue: dict[str, int] = field(default_factory=dict)  # lane -> cap on its waiting sequences (0: none)


@dataclass(frozen=True, slots=True)
class Work:
    """One HTTP request's engine work as admission sees it."""

    lane: str
    prompt_lens: tuple[int, ...]  # one per prompt
    n: int

    @property
    def num_seqs(self) -> int:
        return self.n * len(self.prompt_lens)

    @property
    def num_tokens(self) -> int:
        return self.n * sum(self.prompt_lens)


class AdmissionPolicy:
    def __init__(self, limits: AdmissionLimits):
        self.limits = limits
        self.waiting_seqs = 0
        self.waiting_tokens = 0
        self.waiting_seqs_by_lane: dict[str, int] = {}
        self.waiting_tokens_by_lane: dict[str, int] = {}
        self.prefill_rate: float | None = None  # tokens/s the engine's steps process (moving average)

    def check(self, work: Work) -> None:
        """Raise the APIError that refuses ``work`` (400: never fits, 503: not now); else return."""
        lim = self.limits
        seqs, tokens = work.num_seqs, work.num_tokens
        lane_cap = lim.lane_queue.get(work.lane, 0)
        for cap, amount, waiting, what, flag in (
                (lim.max_waiting_requests, seqs, self.waiting_seqs, "sequences (prompts × n)", "--max-waiting-requests"),
                (lim.max_waiting_tokens, tokens, self.waiting_tokens, "prompt tokens (× n)", "--max-waiting-tokens"),
                (lane_cap or None, seqs, self.waiting_seqs_by_lane.get(work.lane, 0),
                 f"sequences in the {work.lane} lane", f"the {work.lane} lane's queue (--lane-slo)")):
            if cap is None:
                continue
            if amount > cap:
                raise errors.bad_request(f"this request has {amount} {what}, more than the server ever admits at "
                                         f"once ({cap}, {flag})", None, "request_too_large")
            if waiting + amount > cap:
                code = "overloaded" if flag.startswith("--") else "lane_queue_full"
                raise errors.unavailable(f"the server is overloaded ({waiting} {what} waiting, cap {cap}, {flag}); "
                                         "retry later", code)
        ahead = self.waiting_tokens_by_lane.get("interactive", 0)
        if lim.slo_ttft is not None and work.lane == "interactive" and self.prefill_rate and ahead:
            eta = (ahead + tokens) / self.prefill_rate
            if eta > lim.slo_ttft:
                raise errors.unavailable(
                    f"the interactive lane cannot meet its TTFT target of {lim.slo_ttft * 1e3:.0f} ms: "
                    f"about {eta * 1e3:.0f} ms of prompt processing is ahead of this request; retry later",
                    "slo_unattainable", retry_after=max(1, math.ceil(eta - lim.slo_ttft)))

    def add(self, lane: str, num_seqs: int, num_tokens: int) -> None:
        """Count admitted sequences as waiting (the caller calls ``check`` first)."""
        self._move(lane, num_seqs, num_tokens)

    def started(self, lane: str, num_seqs: int, num_tokens: int) -> None:
        """Sequences that got their first token, finished or were aborted: no longer waiting."""
        self._move(lane, -num_seqs, -num_tokens)

    def _move(self, lane: str, seqs: int, tokens: int) -> None:
        self.waiting_seqs += seqs
        self.waiting_tokens += tokens
        self.waiting_seqs_by_lane[lane] = self.waiting_seqs_by_lane.get(lane, 0) + seqs
        self.waiting_tokens_by_lane[lane] = self.waiting_tokens_by_lane.get(lane, 0) + tokens

    def observe_step(self, num_batched_tokens: int, step_duration: float) -> None:
        if num_batched_tokens and step_duration > 0:
            rate = num_batched_tokens / step_duration
            self.prefill_rate = rate if self.prefill_rate is None else 0.8 * self.prefill_rate + 0.2 * rate

    def reset(self) -> None:
        """The engine died: nothing is waiting any more (the rate is kept for the next engine)."""
        self.waiting_seqs = self.waiting_tokens = 0
        self.waiting_seqs_by_lane.clear()
        self.waiting_tokens_by_lane.clear()
