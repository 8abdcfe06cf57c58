"""Scheduling policies (torch-free): who goes first, and how a step's budget is split.

A policy answers four questions for the continuous scheduler (scheduler/scheduler.py):

- queue order: ``key(req)`` ranks waiting requests (lower first), ``order_running`` the
  running ones (by ``key`` unless the policy says otherwise; the last is the first victim
  when KV blocks run out);
- the step's budget: ``step_budget(...)`` decides, once per step, the token budget,
  the prefill cap and each lane's share (``deadline`` sizes it with the step-cost model;
  in a step that speculates, each decode's proposals are part of its decode);
- step-aside: ``steps_aside(req, budget, now)``: a running request skips this step;
- victim choice: ``victim(req, running)``: the running request a waiting one may
  preempt when seats or blocks run out (None: it waits).

``fcfs`` (arrival order), ``priority`` (lower value first, then arrival) and
``deadline`` (lanes: earliest TTFT deadline first) implement it.
"""

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
    """What one step may take; the scheduler spends `tokens` and `lanes` as it plans."""

    tokens: int  # the step's token budget
    prefill_cap: int  # most tokens one request may take in this step
    lanes: dict[str, int]  # most tokens each lane may still take in this step
    top_up: bool = False  # leftover budget goes back to capped requests at the end
    short_first: bool = False  # a short interactive prompt waits: long interactive prefills may step aside
    running_prefill: int = 1 << 62  # most tokens the running prompts' chunks may take together

    @classmethod
    def unlimited(cls) -> "StepBudget":
        n = 1 << 62
        return cls(n, n, dict.fromkeys(LANES, n))

    def take(self, req: Request, wanted: int) -> int:
        """How many of `wanted` tokens `req` may have now (0: none)."""
        return max(0, min(wanted, self.tokens, self.prefill_cap, self.lanes[req.lane]))

    def spend(self, req: Request, n: int) -> None:
        self.tokens -= n
        self.lanes[req.lane] -= n


class SchedulingPolicy:
    """First come, first served; one shared budget; a long prompt is capped beside others
    and topped up with what is left at the end (alone, it loses nothing)."""

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
        """While others need tokens (queued, or running: their decodes), a long prompt takes
        at most the prefill cap, so short requests and decodes share its step instead of
        waiting behind it. `spec_tokens`: proposals a decode may verify this step."""
        budget = self.config.max_num_batched_tokens
        cap = self.prefill_cap if head is not None or len(running) > 1 else budget
        return StepBudget(budget, cap, dict.fromkeys(LANES, budget), top_up=cap < budget)

    def order_running(self, running: Collection[Request]) -> list[Request]:
        """The running requests in the order a step serves them (the last: the first victims)."""
        return sorted(running, key=self.key)

    def steps_aside(self, req: Request, budget: StepBudget, now: float) -> bool:
        return False

    def victim(self, req: Request, running: Collection[Request]) -> Request | None:
        return None


class PriorityPolicy(SchedulingPolicy):
    """As fcfs, ordered by priority (lower first), then arrival."""

    def key(self, req: Request) -> tuple:
        return (req.priority, req.arrival_time, req.seq)


MIN_CHUNK = 16  # prefill tokens a step may always carry, whatever the cost model says
# A prompt's TTFT deadline is its lane's target plus this many times its own prefill time alone.
# At light load nothing waits anyway; under overload short prompts (cheap, and most requests) go
# before long ones that arrived up to this stretch of their work earlier, and no long prompt
# waits forever. Tuned in simulated time (benchmarks/flat_sim.py).
PREFILL_STRETCH = 16.0
# With no decodes running and nobody waiting, the running prompts' steps together last at most the
# interactive TTFT target over this: what a request arriving meanwhile waits before its own step.
LONE_STEP_SHARE = 8


class DeadlinePolicy(SchedulingPolicy):
    """Lanes: earliest TTFT deadline first (arrival + the lane's TTFT target + the prompt's
    prefill time alone, stretched: ``deadline``).

    - Steps sized by the SLO (with a step-cost model, and no --long-prefill-token-threshold):
      while interactive work is on, a step's prefill keeps it within the interactive
      lane's slack over a lone decode's step and within its ``tpot`` target (``slo_sized``);
      ``max_num_batched_tokens`` stays the largest step.

    - No top-up: the prefill cap bounds every step beside others, so running decodes keep
      their ITL and an arriving request waits behind at most one short step.
    - While interactive work is waiting or running, the batch lane takes at most its
      share of a step; the interactive lane never takes the batch lane's share.
    - Shortest prefill first within the interactive lane: when the queue's head is a short
      interactive prompt, a running interactive prompt with more than the cap left skips
      the step, never past its own TTFT deadline (no starvation). The batch lane does not
      step aside: its share is its guarantee.
    - A waiting interactive request may preempt the lowest-ranked running batch request, or an
      interactive prompt still in its prefill that ranks after it.
    """

    def __init__(self, config: SchedulerConfig, cost_model: StepCostModel | None = None):
        super().__init__(config, cost_model)
        self.lanes: Lanes = config.lane_slo

    def key(self, req: Request) -> tuple:
        return (self.deadline(req), req.seq)

    def deadline(self, req: Request) -> float:
        """Arrival + the lane's TTFT target + `PREFILL_STRETCH` times the prefill time alone (by the
        cost model) of the frontend request the prompt is part of: latency in proportion to work.
        One HTTP request of 256 long prompts ranks after a short request that arrives while they
        run, as one long prompt does. Computed once per request."""
        if req.ttft_deadline is None:
            work = 0.0
            if self.cost_model is not None and req.num_prompt_tokens > 1:
                siblings = max(1.0, req.request_prompt_tokens / req.num_prompt_tokens)
                work = self.prefill_alone(req.num_prompt_tokens) * siblings
            req.ttft_deadline = req.arrival_time + self.lanes[req.lane].ttft + PREFILL_STRETCH * work
        return req.ttft_deadline

    def prefill_alone(self, tokens: int) -> float:
        """A prompt's whole prefill in one step with nothing beside it, by the cost model."""
        return self.cost_model.predict(StepShape(0).plus_chunk(0, tokens))

    def step_budget(self, head: Request | None, running: Collection[Request],
                    waiting_by_lane: dict[str, int], now: float = 0.0, spec_tokens: int = 0) -> StepBudget:
        budget = super().step_budget(head, running, waiting_by_lane, now)
        budget.top_up = False
        busy = {lane for lane, n in waiting_by_lane.items() if n} | {r.lane for r in running}
        if ("interactive" in busy and self.cost_model is not None
                and self.config.long_prefill_token_threshold is None):
            idle = not running and sum(waiting_by_lane.values()) == 1
            sized = self.slo_sized(head, running, now, spec_tokens, idle)
            budget.tokens, budget.prefill_cap, budget.running_prefill = sized
        if "interactive" in busy:
            share = int(self.lanes["batch"].share * budget.tokens)
            budget.lanes = {"interactive": budget.tokens - (share if "batch" in busy else 0), "batch": share}
        budget.short_first = (head is not None and head.lane == "interactive"
                              and head.num_tokens <= budget.prefill_cap)
        return budget

    def slo_sized(self, head: Request | None, running: Collection[Request], now: float,
                  spec_tokens: int = 0, idle: bool = False) -> tuple[int, int, int]:
        """(the step's tokens, the prefill cap, what the running prompts' chunks may take
        together) while interactive work is on, by the step-cost model.

        - The cap (``room``): the prefill that keeps the step within ``(1 + slack)`` times a
          lone decode's step (or its decodes' own step, where longer) and within the lane's
          ``tpot`` target; up to the ``tpot`` target when the queue's head is within half its TTFT
          target of its deadline; the whole budget once it is more than that target past it (a
          backlog the SLO has missed anyway clears fastest in full steps); at least `MIN_CHUNK`,
          so prompts always progress.
        - Interactive decodes running: the step is its decodes (with the ``spec_tokens`` proposals
          each may verify) plus ``room`` prefill tokens, which the running prompts share; a waiting
          interactive prompt's first chunk is counted in first and held back from the running
          prompts, so it starts this step even beside long prompts that do not step aside.
        - None: no decode pace to keep. Any number of prompts may start within an eighth of the
          interactive TTFT target (`LONE_STEP_SHARE`), none taking more than ``room``, and the
          running prompts share one ``room``. With nobody waiting either, a lone prompt's chunk
          may double what it has computed, in steps of at most that eighth, so a request arriving
          meanwhile waits one bounded step. A prompt arriving to an idle engine (``idle``) whose
          whole prefill fits a quarter of that target goes in one step: split, it pays more
          steps' fixed costs to spare nobody a wait.

        docs/architecture.md ("Budget") has the simulations and measurements behind each rule."""
        slo = self.lanes["interactive"]
        decodes, start, pace = [], 0, False
        for r in running:
            left = r.num_tokens_with_pending - r.num_computed_tokens
            if left == 1:
                decodes.append((r.num_computed_tokens, 1 + spec_tokens))
                pace = pace or r.lane == "interactive"
            elif left > 1:
                start = max(start, r.num_computed_tokens)  # the costliest place a chunk may go
        base = StepShape.of(decodes)
        lone = self.cost_model.predict(StepShape(1))  # a lone decode's step: what the slack counts from
        alone = self.cost_model.predict(base) if decodes else lone
        target = min(slo.tpot, max((1.0 + slo.slack) * lone, alone))
        if head is not None:
            late, ttft = now - self.deadline(head), self.lanes[head.lane].ttft
            if late > ttft:
                target = math.inf  # a backlog past saving: the full budget clears it fastest
            elif late > -ttft / 2:
                target = slo.tpot
        top = self.config.max_num_batched_tokens
        limit = top - base.num_tokens
        room = max(min(MIN_CHUNK, limit), self.cost_model.max_chunk(base, start, limit, target), 1)
        if not pace:  # no decode pace to keep: a burst of prompts may share the step, none past `room`
            if head is None:  # nor anyone waiting: a lone prompt's chunk may double what it has computed,
                # in steps a request arriving meanwhile waits behind for at most an eighth of its TTFT target;
                # prompts running together share that room (two taking it each made a step twice as long)
                room = max(room, min(start, self.cost_model.max_chunk(base, start, limit, slo.ttft / LONE_STEP_SHARE)))
                return top, room, room
            if idle and self.prefill_alone(head.num_tokens) <= slo.ttft / 4:
                room = max(room, head.num_tokens)
                return top, room, top
            # a request arriving meanwhile waits at most an eighth of its TTFT target here too
            step = max(room, self.cost_model.max_chunk(base, 0, limit, slo.ttft / LONE_STEP_SHARE))
            return step, room, room
        if head is None or head.lane != "interactive":
            return min(top, base.num_tokens + room), room, room
        # the head's first chunk counts in the step's time; what is left goes to running prompts
        starting = min(head.num_tokens, room)
        rest = self.cost_model.max_chunk(base.plus_chunk(0, starting), start, limit - starting, target)
        rest = max(rest, min(MIN_CHUNK, limit - starting))  # the head gets a chunk after a long one's
        return min(top, base.num_tokens + starting + rest), max(starting, rest), rest

    def order_running(self, running: Collection[Request]) -> list[Request]:
        """Decodes by deadline, then prompts by the tokens they have left, fewest first (ties by
        deadline). The running prompts share one prefill room (``slo_sized``): a short prompt
        past its first chunk finishes in the next steps, before a long one takes the room again
        (by deadline alone, a long prompt past its deadline took the whole room every step while a
        short one beside it waited for all of its prefill). Among long prompts too the one nearest
        its first token goes first; none waits for a longer one."""
        def rank(r: Request) -> tuple:
            left = r.num_tokens_with_pending - r.num_computed_tokens
            return (left > 1, left if left > 1 else 0, self.key(r))
        return sorted(running, key=rank)

    def steps_aside(self, req: Request, budget: StepBudget, now: float) -> bool:
        """A long interactive prompt (more than the cap left) skips the step that admits a
        short one: the short one's first step is short. Never past its own deadline."""
        if not budget.short_first or req.lane != "interactive":
            return False
        if req.num_tokens - req.num_computed_tokens <= budget.prefill_cap:
            return False  # a decode, or a prompt whose rest fits this step
        return now < self.deadline(req)

    def victim(self, req: Request, running: Collection[Request]) -> Request | None:
        """For an interactive request: the lowest-ranked running batch request, else the
        lowest-ranked prompt still in its prefill that ranks after it (one request's 256 prompts
        may hold every seat; a preempted prompt's full blocks stay in the prefix cache). A
        decoding interactive request is never preempted for another: its stream would stall."""
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
