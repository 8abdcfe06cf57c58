"""Who runs this step, and how many tokens each (torch-free).

Batching modes: ``continuous`` (below; the default), and ``static``/``dynamic``, which
exist to reproduce flat latency side by side: fixed batches run to completion.

One unified token budget per step (``max_num_batched_tokens``): running requests
first (decodes and unfinished prompt chunks, in policy order), then waiting ones in
policy order while budget, ``max_num_seqs`` and KV blocks allow. A prompt longer than
what is left of the budget is chunked by clamping; prefill and decode share the step.
When blocks run out, the lowest-ranked running request is preempted (its blocks are
freed and it is recomputed later, helped by the prefix cache).
"""

from __future__ import annotations

import heapq
import itertools
import time

from expresslane.config import SchedulerConfig
from expresslane.engine.contract import EngineCoreOutput, ScheduledSeq, StepPlan
from expresslane.engine.kv_cache import KVCacheManager
from expresslane.engine.lanes import parse_lane_slo
from expresslane.engine.request import Request, RequestStatus


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, clock=time.monotonic):
        self.config = config
        self.kv = kv
        self.clock = clock
        self.requests: dict[str, Request] = {}
        self.running: dict[str, Request] = {}  # insertion-ordered; O(1) removal
        self._waiting: list[tuple[tuple, Request]] = []  # heap by policy key; aborted ones removed lazily
        self._num_waiting = 0
        self._finished_ids: list[str] = []  # for the runner: since the last plan it saw
        self._preempted_ids: list[str] = []
        self._step_ids = itertools.count()
        self._in_flight: dict[int, list[tuple[Request, int]]] = {}  # step id -> its (request, tokens)
        self.num_preemptions = 0
        self.lanes = parse_lane_slo(config.lane_slo)
        self._lanes_on = config.scheduling_policy == "deadline"
        self._waiting_by_lane = dict.fromkeys(self.lanes, 0)

    # -- queue -------------------------------------------------------------------------
    def _key(self, req: Request) -> tuple:
        if self.config.scheduling_policy == "priority":
            return (req.priority, req.arrival_time, req.seq)
        if self._lanes_on:  # earliest TTFT deadline first
            return (req.arrival_time + self.lanes[req.lane].ttft, req.seq)
        return (req.arrival_time, req.seq)

    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in the engine")
        self.requests[req.request_id] = req
        self._push_waiting(req)

    def _push_waiting(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        heapq.heappush(self._waiting, (self._key(req), req))
        self._num_waiting += 1
        self._waiting_by_lane[req.lane] += 1

    def _peek_waiting(self) -> Request | None:
        while self._waiting and self._waiting[0][1].is_finished:
            heapq.heappop(self._waiting)  # aborted while waiting
        return self._waiting[0][1] if self._waiting else None

    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # -- one step ------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        if self.config.batching == "continuous":
            scheduled = self._schedule_continuous()
        else:
            scheduled = self._schedule_fixed_batch()
        plan = StepPlan(next(self._step_ids), [], sum(n for _, n in scheduled))
        if not scheduled:
            return plan  # (an empty plan is not executed: the runner hears of finished ones later)
        plan.finished_request_ids, self._finished_ids = self._finished_ids, []
        plan.preempted_request_ids, self._preempted_ids = self._preempted_ids, []
        for req, n in scheduled:
            if req.num_blocks_sent == 0:
                plan.new_requests.append(req.runner_state())
            plan.seqs.append(self._describe(req, n))
            # the step will compute them: later plans build on that
            req.num_computed_tokens += n
            if req.num_computed_tokens == req.num_tokens_with_pending:
                req.num_pending += 1
        self._in_flight[plan.step_id] = scheduled
        return plan

    @property
    def _prefill_cap(self) -> int:
        t = self.config.long_prefill_token_threshold
        if t is None:
            t = self.config.max_num_batched_tokens // 4
        return t or self.config.max_num_batched_tokens

    def _schedule_continuous(self) -> list[tuple[Request, int]]:
        """While others need tokens (queued, or running: their decodes), a long prompt takes
        at most `_prefill_cap` tokens, so short requests and decodes share its step instead
        of waiting behind it. Under fcfs/priority the leftover budget is given back to the
        capped prompts at the end (alone, a long prompt loses nothing); under `deadline` it
        is not: the cap then bounds every step beside others, so running decodes keep their
        ITL and a new interactive request never waits behind a big step."""
        budget = self.config.max_num_batched_tokens
        head = self._peek_waiting()
        others = head is not None or len(self.running) > 1
        cap = self._prefill_cap if others else budget
        lanes = self._lane_budget(budget)
        # deadline: a waiting short interactive prompt makes long interactive prefills step aside
        short_waiting = lanes is not None and head is not None and head.lane == "interactive" \
            and head.num_tokens <= cap
        scheduled, budget, preempted = self._schedule_running(budget, cap, lanes, short_waiting)
        if not preempted:
            budget = self._admit(scheduled, budget, self.config.max_num_seqs, cap, lanes)
            if cap < self.config.max_num_batched_tokens and lanes is None:
                self._top_up(scheduled, budget)
        return scheduled

    def _lane_budget(self, budget: int) -> dict[str, int] | None:
        """Under `deadline`: tokens each lane may take this step. A lane with work keeps its
        share from the other; while interactive work is waiting or running, the batch lane
        gets only its share, so the steps that carry interactive tokens stay short."""
        if not self._lanes_on:
            return None
        busy = {lane for lane, n in self._waiting_by_lane.items() if n}
        busy |= {r.lane for r in self.running.values()}
        batch_share = int(self.lanes["batch"].share * budget)
        if "interactive" not in busy:
            return {"interactive": budget, "batch": budget}
        return {"interactive": budget - (batch_share if "batch" in busy else 0), "batch": batch_share}

    def _steps_aside(self, req: Request, cap: int) -> bool:
        """Shortest prefill first within the interactive lane: a long interactive prompt
        (more than `cap` tokens left) skips the step that admits a short one, so the short
        one's first step is short (it saves the short ones a chunk's time; it costs the
        long one a step). Never past the long one's own TTFT deadline: no starvation."""
        if req.lane != "interactive" or req.num_tokens - req.num_computed_tokens <= cap:
            return False  # a decode, or a prompt whose rest fits this step
        return self.clock() < req.arrival_time + self.lanes["interactive"].ttft

    def _top_up(self, scheduled: list[tuple[Request, int]], budget: int) -> None:
        for i, (req, n) in enumerate(scheduled):
            if budget == 0:
                break
            extra = min(req.num_tokens_with_pending - req.num_computed_tokens - n, budget)
            if extra > 0 and self.kv.allocate_slots(req, n + extra):
                scheduled[i] = (req, n + extra)
                budget -= extra

    def _schedule_fixed_batch(self) -> list[tuple[Request, int]]:
        """static/dynamic: a batch is admitted only when none runs, its prompts are prefilled
        whole in one step (no budget, no chunking), and it decodes until all members finish."""
        unlimited = 1 << 62
        if self.running:
            scheduled, _, _ = self._schedule_running(unlimited, unlimited)
            return scheduled
        if not self._batch_ready():
            return []
        scheduled: list[tuple[Request, int]] = []
        self._admit(scheduled, unlimited, min(self.config.max_batch_size, self.config.max_num_seqs), unlimited)
        return scheduled

    def _batch_ready(self) -> bool:
        head = self._peek_waiting()
        if head is None:
            return False
        if self.config.batching == "static" or self._num_waiting >= self.config.max_batch_size:
            return True
        return self.clock() - head.arrival_time >= self.config.batch_timeout_ms / 1000

    def _schedule_running(self, budget: int, cap: int, lanes: dict[str, int] | None = None,
                          short_waiting: bool = False) -> tuple[list[tuple[Request, int]], int, bool]:
        """Running requests in policy order; preempt from the lowest-ranked end when blocks run out."""
        scheduled: list[tuple[Request, int]] = []
        preempted = False
        order = sorted(self.running.values(), key=self._key)
        tail = len(order)  # order[i:tail] (after i += 1): not yet scheduled; victims come from the end
        i = 0
        while i < tail and budget > 0:
            req = order[i]
            i += 1
            if req.num_pending and req.will_finish_by_length():
                continue  # its last token is being sampled now
            if short_waiting and self._steps_aside(req, cap):
                continue
            n = min(req.num_tokens_with_pending - req.num_computed_tokens, budget, cap)
            if lanes is not None:
                n = min(n, lanes[req.lane])
                if n <= 0:
                    continue  # its lane's share of this step is spent
            while not self.kv.allocate_slots(req, n):
                if tail > i:
                    tail -= 1
                    victim = order[tail]
                else:
                    victim, tail = req, i - 1
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            else:
                scheduled.append((req, n))
                budget -= n
                if lanes is not None:
                    lanes[req.lane] -= n
        return scheduled, budget, preempted

    def _admit(self, scheduled: list[tuple[Request, int]], budget: int, max_running: int, cap: int,
               lanes: dict[str, int] | None = None) -> int:
        """Waiting requests in policy order while budget, seats and blocks allow."""
        while budget > 0:
            req = self._peek_waiting()
            if req is None or req.num_pending:
                break  # (a preempted request waits until its in-flight token has landed)
            if len(self.running) >= max_running:
                freed = self._make_room(req, scheduled, lanes)
                if freed is None:
                    break
                budget += freed
                continue
            cached = self.kv.find_cached_prefix(req)
            num_cached = len(cached) * self.kv.block_size
            n = min(req.num_tokens - num_cached, budget, cap)
            if lanes is not None:
                n = min(n, lanes[req.lane])
                if n <= 0:
                    break  # the head's lane has spent its share of this step
            if not self.kv.allocate_slots(req, n, cached):
                freed = self._make_room(req, scheduled, lanes)
                if freed is None:
                    break  # the head waits for blocks; later requests do not overtake it
                budget += freed
                continue
            heapq.heappop(self._waiting)
            self._num_waiting -= 1
            self._waiting_by_lane[req.lane] -= 1
            self.kv.record_lookup(req.num_tokens, num_cached)
            req.num_computed_tokens = num_cached
            if req.first_scheduled_time is None:
                req.first_scheduled_time = self.clock()
                req.num_cached_tokens = num_cached
            req.status = RequestStatus.RUNNING
            self.running[req.request_id] = req
            scheduled.append((req, n))
            budget -= n
            if lanes is not None:
                lanes[req.lane] -= n
        return budget

    def _make_room(self, req: Request, scheduled: list[tuple[Request, int]],
                   lanes: dict[str, int] | None) -> int | None:
        """Under `deadline`, a waiting interactive request preempts the lowest-ranked running
        batch request (taking it out of this step if it was in). Returns the step budget
        given back, or None when there is no such victim."""
        if lanes is None or req.lane != "interactive":
            return None
        victims = [r for r in self.running.values() if r.lane == "batch"]
        if not victims:
            return None
        victim = max(victims, key=self._key)
        freed = 0
        for i, (r, n) in enumerate(scheduled):
            if r is victim:
                del scheduled[i]
                freed = n
                lanes[victim.lane] += n
                break
        self._preempt(victim)
        return freed

    def _describe(self, req: Request, n: int) -> ScheduledSeq:
        start = req.num_computed_tokens
        known = req.all_token_ids[start:start + n]
        new_blocks = self.kv.block_ids(req.request_id, req.num_blocks_sent)
        req.num_blocks_sent += len(new_blocks)
        return ScheduledSeq(
            request_id=req.request_id,
            token_ids=known if len(known) == n else known + [0],
            start_pos=start,
            new_block_ids=new_blocks,
            sample=start + n == req.num_tokens_with_pending,
            from_previous=len(known) < n,
        )

    def _preempt(self, req: Request) -> None:
        # Blocks may still be written by a step in flight; the GPU runs steps in order, so
        # whoever gets them next writes after that step.
        del self.running[req.request_id]
        self.kv.free(req)
        req.num_computed_tokens = 0
        if req.num_blocks_sent:
            req.num_blocks_sent = 0
            self._preempted_ids.append(req.request_id)
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._push_waiting(req)

    def update(self, plan: StepPlan, sampled: dict[str, int],
               logprobs: dict[str, dict[int, float]] | None = None) -> list[EngineCoreOutput]:
        """Apply a finished step's sampled tokens. Later plans may already be in flight: a
        request finished or aborted since then ignores its token, a preempted one keeps it."""
        now = self.clock()
        outputs = []
        for req, _ in self._in_flight.pop(plan.step_id, ()):
            token = sampled.get(req.request_id)
            if token is None:
                continue  # a prompt chunk that does not reach the end yet
            req.num_pending -= 1
            if req.is_finished:
                continue
            req.append_token(token)
            first = req.first_token_time is None
            if first:
                req.first_token_time = now
            # A step's logprobs has a row for every request, None where that request asked for none.
            lp = logprobs.get(req.request_id) if logprobs else None
            out = EngineCoreOutput(req.request_id, [token], num_cached_tokens=req.num_cached_tokens,
                                   new_logprobs=None if lp is None else [lp])
            if first:
                out.first_scheduled_time, out.first_token_time = req.first_scheduled_time, now
            if req.finish_reason is not None:
                self._finish(req, now)
                out.finish_reason, out.stop_reason, out.finished_time = req.finish_reason, req.stop_reason, now
            outputs.append(out)
        return outputs

    def _finish(self, req: Request, now: float) -> None:
        was_running = req.status is RequestStatus.RUNNING
        req.status = RequestStatus.FINISHED
        if was_running:
            del self.running[req.request_id]
        else:
            self._num_waiting -= 1
            self._waiting_by_lane[req.lane] -= 1
        self.kv.free(req)
        del self.requests[req.request_id]
        self._finished_ids.append(req.request_id)

    def abort(self, request_ids: list[str]) -> list[EngineCoreOutput]:
        now = self.clock()
        outputs = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None:
                continue  # already finished: aborting is idempotent
            req.finish_reason = "abort"
            self._finish(req, now)
            outputs.append(EngineCoreOutput(rid, [], finish_reason="abort", finished_time=now,
                                            num_cached_tokens=max(req.num_cached_tokens, 0)))
        return outputs
