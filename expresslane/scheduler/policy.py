"""Scheduling policies: queue order, step budget, step-aside, victims (docs/architecture.md,
"Budget")."""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass

from expresslane.config import SchedulerConfig
from expresslane.cost_model.base import StepCostModel, StepShape
from expresslane.scheduler.request import Request, RequestStatus
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
    whole: int = 0  # waiting interactive prompts up to this: whole
    starts: int = 1 << 62  # other waiting prompts' first chunks, together

    @classmethod
    def unlimited(cls) -> "StepBudget":
        n = 1 << 62
        return cls(n, n, dict.fromkeys(LANES, n))

    def take(self, req: Request, wanted: int) -> int:
        """What `req` may have of `wanted`; books a waiting prompt's first chunk."""
        waiting = req.status is RequestStatus.WAITING
        whole = waiting and wanted <= self.whole and req.lane == "interactive"
        cap = wanted if whole else min(self.prefill_cap, self.starts) if waiting else self.prefill_cap
        n = max(0, min(wanted, self.tokens, cap, self.lanes[req.lane]))
        if waiting and not whole:
            self.starts -= n
        return n

    def spend(self, req: Request, n: int) -> None:
        self.tokens -= n
        self.lanes[req.lane] -= n


def lone_chunk(knee: int, left: int, limit: int) -> int:
    return left if knee < left < 2 * knee and left <= limit else min(knee, left)


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
        alone = len(running) + sum(waiting_by_lane.values()) <= 1
        cap = budget if alone else self.prefill_cap
        return StepBudget(budget, cap, dict.fromkeys(LANES, budget), top_up=cap < budget)

    def order_running(self, running: Collection[Request], now: float = 0.0) -> list[Request]:
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

    def prefill_alone(self, tokens: int, start: int = 0) -> float:
        return self.cost_model.predict(StepShape(0).plus_chunk(start, tokens))

    def due(self, req: Request, now: float) -> bool:
        """Its deadline, less the last step (`tpot`), is within `aging_factor` x its prefill left alone."""
        deadline, aging = self.deadline(req), self.config.aging_factor
        if self.cost_model is None or now >= deadline:
            return now >= deadline
        lane = self.lanes[req.lane]
        land = deadline - lane.tpot
        stretch = self.config.prefill_stretch  # whole prompt's work >= work left
        if stretch and now < land - aging * (deadline - req.arrival_time - lane.ttft) / stretch:
            return False
        left = req.num_tokens - req.num_computed_tokens
        return left > 0 and now >= land - aging * self.prefill_alone(left, req.num_computed_tokens)

    def step_budget(self, head: Request | None, running: Collection[Request],
                    waiting_by_lane: dict[str, int], now: float = 0.0, spec_tokens: int = 0) -> StepBudget:
        budget = super().step_budget(head, running, waiting_by_lane, now)
        budget.top_up = False
        busy = {lane for lane, n in waiting_by_lane.items() if n} | {r.lane for r in running}
        sized = ("interactive" in busy and self.cost_model is not None
                 and self.config.long_prefill_token_threshold is None)
        if sized:
            sizes = self.slo_sized(head, running, waiting_by_lane, now, spec_tokens)
            budget.tokens, budget.prefill_cap, budget.running_prefill, budget.whole, budget.starts = sizes
        if "interactive" in busy:  # sized: holds interactive work
            share = int(self.lanes["batch"].share * budget.tokens)
            budget.lanes = {"interactive": budget.tokens - (share if "batch" in busy and not sized else 0),
                            "batch": share}
        budget.short_first = (head is not None and head.lane == "interactive"
                              and head.num_tokens <= max(budget.prefill_cap, budget.whole))
        return budget

    def slo_sized(self, head: Request | None, running: Collection[Request], waiting_by_lane: dict[str, int], now: float,
                  spec_tokens: int = 0) -> tuple[int, int, int, int, int]:
        """(tokens, cap, running share, whole, starts): targets as ceilings."""
        slo, top = self.lanes["interactive"], self.config.max_num_batched_tokens
        decodes, start, pace, due, batch_only, prompts = [], 0, False, False, True, 0
        for r in running:
            left = r.num_tokens_with_pending - r.num_computed_tokens
            if left == 1:
                decodes.append((r.num_computed_tokens, 1 + spec_tokens))
                pace = pace or r.lane == "interactive"
            elif left > 1:
                start = max(start, r.num_computed_tokens)  # costliest place for a chunk
                prompts += left
                due = due or self.due(r, now)
                batch_only = batch_only and r.lane == "batch"
        waiting = sum(waiting_by_lane.values())
        base = StepShape.of(decodes)
        limit = top - base.num_tokens
        if (not pace and not waiting) or (not running and waiting == 1):  # nothing to protect
            knee = self.cost_model.knee(base, start, limit, self.config.knee_margin)
            step = lone_chunk(knee, prompts if running else head.num_tokens - head.num_computed_tokens, limit)
            return min(top, base.num_tokens + step), step, step, step, step
        lone = self.cost_model.predict(StepShape(1))
        alone = self.cost_model.predict(base) if decodes else lone
        slack = min(slo.tpot, max((1.0 + slo.slack) * lone, alone))  # for others' prefill
        ceiling = slo.tpot if pace else slo.ttft / self.config.lone_step_share  # for starters
        if due:
            slack = ceiling if pace else math.inf
        late = now - self.deadline(head) if head is not None else -math.inf
        if late > 0:
            ceiling = math.inf
        if late > slo.ttft:
            slack = math.inf
        floor = min(self.config.min_prefill_chunk, limit)
        room = max(floor, self.cost_model.max_chunk(base, start, limit, slack), 1)
        if head is None or head.lane != "interactive":
            return min(top, base.num_tokens + room), room, room, 0, room
        whole = max(min(limit, self.prefill_cap), self.cost_model.max_chunk(base, 0, limit, ceiling))
        starting = head.num_tokens if head.num_tokens <= whole else min(head.num_tokens, room)
        if due and starting == head.num_tokens:  # room for starters like the head
            starting = max(starting, min(limit, whole, waiting_by_lane["interactive"] * head.num_tokens))
        elif batch_only and starting == head.num_tokens and slack < math.inf:
            slack = self.cost_model.predict(base.plus_chunk(0, starting))  # batch only where free
        rest = self.cost_model.max_chunk(base.plus_chunk(0, starting), start, limit - starting, slack)
        rest = max(rest, min(floor - starting, limit - starting))  # floor: the step's, shared
        if starting < head.num_tokens:  # long: one start a step
            return min(top, base.num_tokens + rest + starting), max(room, rest), rest, 0, starting
        fill = limit - rest
        if pace:
            fill = max(starting, self.cost_model.max_chunk(base.plus_chunk(start, rest), 0, fill, ceiling))
        return min(top, base.num_tokens + rest + fill), max(room, rest), rest, whole, room

    def order_running(self, running: Collection[Request], now: float = 0.0) -> list[Request]:
        """Decodes by deadline, then prompts: due first, then fewest tokens left."""
        def rank(r: Request) -> tuple:
            left = r.num_tokens_with_pending - r.num_computed_tokens
            if left <= 1:
                return (False, False, 0, self.key(r))
            return (True, not self.due(r, now), left, self.key(r))
        return sorted(running, key=rank)

    def steps_aside(self, req: Request, budget: StepBudget, now: float) -> bool:
        """A long interactive prompt skips a step that admits a short one, until it is due."""
        if not budget.short_first or req.lane != "interactive":
            return False
        if req.num_tokens - req.num_computed_tokens <= budget.prefill_cap:
            return False
        return not self.due(req, now)

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
