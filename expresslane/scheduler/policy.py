"""Scheduling policies: queue order, step budget, step-aside, victims (docs/architecture.md,
"Budget")."""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass

from expresslane.config import SchedulerConfig
from expresslane.cost_model.base import StepCostModel, StepShape
from expresslane.scheduler.request import Request
from expresslane.lanes import LANES, Lanes


@dataclass(slots=True)
class StepBudget:
    """What one step may take."""

    tokens: int
    prefill_cap: int  # per request
    lanes: dict[str, int]  # per lane, left
    top_up: bool = False  # leftover budget goes back to capped requests
    short_first: bool = False  # long interactive prefills may step aside
    running_prefill: int = 1 << 62  # the running prompts' chunks together

    @classmethod
    def unlimited(cls) -> "StepBudget":
        n = 1 << 62
        return cls(n, n, dict.fromkeys(LANES, n))

    def take(self, req: Request, wanted: int) -> int:
        """Of `wanted` tokens, what `req` may have now."""
        return max(0, min(wanted, self.tokens, self.prefill_cap, self.lanes[req.lane]))

    def spend(self, req: Request, n: int) -> None:
        self.tokens -= n
        self.lanes[req.lane] -= n


class SchedulingPolicy:
    """Arrival order; a long prompt is capped beside others, then topped up."""

    def __init__(self, config: SchedulerConfig, cost_model: StepCostModel | None = None):
        self.config = config
        self.cost_model = cost_model

    def key(self, req: Request) -> tuple:
        return (req.arrival_time, req.seq)

    @property
    def prefill_cap(self) -> int:
        t = self.config.long_prefill_token_threshold
        if t is None:
            t = self.config.max_num_batched_tokens // 4
        return t or self.config.max_num_batched_tokens

    def step_budget(self, head: Request | None, running: Collection[Request],
                    waiting_by_lane: dict[str, int], now: float = 0.0, spec_tokens: int = 0) -> StepBudget:
        budget = self.config.max_num_batched_tokens
        cap = self.prefill_cap if head is not None or len(running) > 1 else budget
        return StepBudget(budget, cap, dict.fromkeys(LANES, budget), top_up=cap < budget)

    def order_running(self, running: Collection[Request]) -> list[Request]:
        return sorted(running, key=self.key)

    def steps_aside(self, req: Request, budget: StepBudget, now: float) -> bool:
        return False

    def victim(self, req: Request, running: Collection[Request]) -> Request | None:
        return None


class PriorityPolicy(SchedulingPolicy):
    """fcfs by priority (lower first)."""

    def key(self, req: Request) -> tuple:
        return (req.priority, req.arrival_time, req.seq)


class DeadlinePolicy(SchedulingPolicy):
    """Earliest TTFT deadline first; steps sized by the SLO; batch takes its share."""

    def __init__(self, config: SchedulerConfig, cost_model: StepCostModel | None = None):
        super().__init__(config, cost_model)
        self.lanes: Lanes = config.lane_slo

    def key(self, req: Request) -> tuple:
        return (self.deadline(req), req.seq)

    def deadline(self, req: Request) -> float:
        """Arrival + TTFT target + `prefill_stretch` x the frontend request's lone prefill."""
        if req.ttft_deadline is None:
            work = 0.0
            if self.cost_model is not None and req.num_prompt_tokens > 1:
                siblings = max(1.0, req.request_prompt_tokens / req.num_prompt_tokens)
                work = self.prefill_alone(req.num_prompt_tokens) * siblings
            req.ttft_deadline = req.arrival_time + self.lanes[req.lane].ttft + self.config.prefill_stretch * work
        return req.ttft_deadline

    def prefill_alone(self, tokens: int) -> float:
        return self.cost_model.predict(StepShape(0).plus_chunk(0, tokens))

    def step_budget(self, head: Request | None, running: Collection[Request],
                    waiting_by_lane: dict[str, int], now: float = 0.0, spec_tokens: int = 0) -> StepBudget:
        budget = super().step_budget(head, running, waiting_by_lane, now)
        budget.top_up = False
        busy = {lane for lane, n in waiting_by_lane.items() if n} | {r.lane for r in running}
        if ("interactive" in busy and self.cost_model is not None
                and self.config.long_prefill_token_threshold is None):
            idle = not running and sum(waiting_by_lane.values()) == 1
            sized = self.slo_sized(head, running, now, spec_tokens, idle, waiting_by_lane.get("interactive", 0))
            budget.tokens, budget.prefill_cap, budget.running_prefill = sized
        if "interactive" in busy:
            share = min(int(self.lanes["batch"].share * budget.tokens), budget.running_prefill)
            budget.lanes = {"interactive": budget.tokens - (share if "batch" in busy else 0), "batch": share}
        budget.short_first = (head is not None and head.lane == "interactive"
                              and head.num_tokens <= budget.prefill_cap)
        return budget

    def slo_sized(self, head: Request | None, running: Collection[Request], now: float,
                  spec_tokens: int = 0, idle: bool = False, waiting_interactive: int = 1) -> tuple[int, int, int]:
        """(step tokens, prefill cap, running prompts' share) within the interactive SLO."""
        slo = self.lanes["interactive"]
        decodes, start, pace = [], 0, False
        for r in running:
            left = r.num_tokens_with_pending - r.num_computed_tokens
            if left == 1:
                decodes.append((r.num_computed_tokens, 1 + spec_tokens))
                pace = pace or r.lane == "interactive"
            elif left > 1:
                start = max(start, r.num_computed_tokens)  # the costliest place for a chunk
        base = StepShape.of(decodes)
        lone = self.cost_model.predict(StepShape(1))
        alone = self.cost_model.predict(base) if decodes else lone
        target = min(slo.tpot, max((1.0 + slo.slack) * lone, alone))
        if head is not None:
            late, ttft = now - self.deadline(head), self.lanes[head.lane].ttft
            if late > ttft:
                target = math.inf  # a missed backlog clears fastest in full steps
            elif late > -ttft / 2:
                target = slo.tpot
        top = self.config.max_num_batched_tokens
        limit = top - base.num_tokens
        room = max(min(self.config.min_prefill_chunk, limit), self.cost_model.max_chunk(base, start, limit, target), 1)
        if not pace:
            if head is None:  # lone prompts: chunks up to double what is computed
                grown = self.cost_model.max_chunk(base, start, limit, self.lone_step(base, start))
                room = max(room, min(start, grown))
                return top, room, room
            if idle and self.prefill_alone(head.num_tokens) <= slo.ttft / 4:
                room = max(room, head.num_tokens)
                return top, room, top
            step = max(room, self.cost_model.max_chunk(base, 0, limit, self.lone_step(base, 0)))
            first = self.whole_prompts(head, base, limit, waiting_interactive)
            if first:
                return max(step, base.num_tokens + first), max(room, head.num_tokens), room
            return step, room, room
        if head is None or head.lane != "interactive":
            return min(top, base.num_tokens + room), room, room
        # the head's first chunk first; running prompts share the rest
        first = self.whole_prompts(head, base, limit, waiting_interactive)
        starting = first or min(head.num_tokens, room)
        rest = self.cost_model.max_chunk(base.plus_chunk(0, starting), start, limit - starting, target)
        rest = max(rest, min(self.config.min_prefill_chunk - starting, limit - starting))  # the floor is the step's, shared
        cap = head.num_tokens if first else starting
        return min(top, base.num_tokens + starting + rest), max(cap, rest), rest

    def whole_prompts(self, head: Request | None, base: StepShape, limit: int, waiting: int,
                      target: float | None = None) -> int:
        """Tokens of the waiting interactive prompts that start whole within `target` (TPOT)."""
        if head is None or head.lane != "interactive":
            return 0
        tpot, n = self.lanes["interactive"].tpot if target is None else target, head.num_tokens
        lo, hi = 0, min(waiting, limit // n)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.cost_model.predict(base.plus_chunk(0, n, mid)) <= tpot:
                lo = mid
            else:
                hi = mid - 1
        return lo * n

    def lone_step(self, base: StepShape, start: int) -> float:
        """Seconds a lone step may last."""
        cheapest = self.cost_model.predict(base.plus_chunk(start, self.config.min_prefill_chunk))
        return max(self.lanes["interactive"].ttft / self.config.lone_step_share, 2 * cheapest)

    def order_running(self, running: Collection[Request]) -> list[Request]:
        """Decodes by deadline, then prompts by tokens left, fewest first."""
        def rank(r: Request) -> tuple:
            left = r.num_tokens_with_pending - r.num_computed_tokens
            return (left > 1, left if left > 1 else 0, self.key(r))
        return sorted(running, key=rank)

    def steps_aside(self, req: Request, budget: StepBudget, now: float) -> bool:
        """A long interactive prompt skips a step that admits a short one, until its deadline."""
        if not budget.short_first or req.lane != "interactive":
            return False
        if req.num_tokens - req.num_computed_tokens <= budget.prefill_cap:
            return False
        return now < self.deadline(req)

    def victim(self, req: Request, running: Collection[Request]) -> Request | None:
        """The lowest-ranked batch request, else a later-ranked prefill."""
        if req.lane != "interactive":
            return None
        batch = [r for r in running if r.lane == "batch"]
        if batch:
            return max(batch, key=self.key)
        key = self.key(req)
        later = [r for r in running if r.num_output_tokens == 0 and not r.num_pending and self.key(r) > key]
        return max(later, key=self.key) if later else None


POLICIES: dict[str, type[SchedulingPolicy]] = {
    "fcfs": SchedulingPolicy, "priority": PriorityPolicy, "deadline": DeadlinePolicy}
