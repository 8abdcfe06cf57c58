"""Continuous batching: a token budget per step, running requests then waiting ones, in policy
order; prompts chunked to the budget; the lowest-ranked preempted when KV blocks run out."""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Collection

from expresslane.config import SchedulerConfig
from expresslane.contract import EngineCoreOutput, ScheduledSeq, ScoredPrompt, StepPlan
from expresslane.cost_model.base import StepCostModel, StepShape
from expresslane.scheduler.kv_cache import KVCacheManager
from expresslane.scheduler.partitions import Split, SplitPolicy
from expresslane.scheduler.policy import POLICIES, StepBudget
from expresslane.scheduler.request import Request, RequestStatus
from expresslane.scheduler.spec_decode import SpecDecoder
from expresslane.lanes import LANES


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, clock=time.monotonic,
                 cost_model: StepCostModel | None = None, spec: SpecDecoder | None = None, max_loras: int = 0,
                 rope_restart_at: int = 0):
        self.config = config
        # longrope restarts a request growing past this (layers/rotary.py); 0: never
        self.rope_restart_at = rope_restart_at
        self.kv = kv
        self.clock = clock
        self.policy = POLICIES[config.scheduling_policy](config, cost_model)
        self.requests: dict[str, Request] = {}
        self.running: dict[str, Request] = {}
        self._waiting: list[tuple[tuple, Request]] = []  # heap; aborted ones popped lazily
        self._num_waiting = 0
        self._waiting_by_lane = dict.fromkeys(LANES, 0)
        self._finished_ids: list[str] = []  # since the last plan
        self._preempted_ids: list[str] = []
        self._step_ids = itertools.count()
        self._in_flight: dict[int, list[tuple[Request, int]]] = {}  # step id -> (request, tokens)
        self.num_preemptions = 0
        self.spec = spec
        self._proposals: dict[str, list[int]] = {}  # this plan's proposals
        self._speculate: bool | None = None  # `speculating()`'s answer, until a change
        self.max_loras = max_loras
        self._step_loras: set[int] = set()
        self.lora_ready: set[int] | None = None  # None: all
        self.lora_wanted: dict[int, None] = {}  # passed over, not ready
        self.splits: SplitPolicy | None = None
        self.split: Split | None = None
        self.in_prefill_lane: set[str] = set()  # its step in flight
        self._long: set[str] = set()  # the prefill lane's prompts
        self._prefill_step: int | None = None
        self._blocks_of: dict[int, list] = {}

    def enable_two_lanes(self, splits: SplitPolicy) -> None:
        """`schedule(lane)`; `split`: each lane's SMs."""
        if self.spec is not None:
            raise ValueError("two lanes (pd_lanes): not with speculative decoding")
        self.splits, self.split = splits, splits.whole(decode=True)
        self.kv.two_lanes(lambda: frozenset(self._in_flight))

    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in the engine")
        self.requests[req.request_id] = req
        self._push_waiting(req)

    def _push_waiting(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        heapq.heappush(self._waiting, (self.policy.key(req), req))
        self._num_waiting += 1
        self._waiting_by_lane[req.lane] += 1

    def _peek_waiting(self) -> Request | None:
        while self._waiting and self._waiting[0][1].is_finished:
            heapq.heappop(self._waiting)
        return self._waiting[0][1] if self._waiting else None

    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def schedule(self, lane: str | None = None) -> StepPlan:
        """`lane`: None (mixed), "prefill" or "decode"."""
        self._step_loras.clear()
        self.lora_wanted.clear()
        if lane is not None and self.splits is None:
            raise ValueError(f"lane {lane!r}: two lanes are not enabled")
        if lane == "prefill" and self.in_prefill_lane:
            raise RuntimeError("a prefill step is already in flight")
        scheduled = self._schedule_prefill_lane() if lane == "prefill" else self._schedule(lane)
        plan = StepPlan(next(self._step_ids), [], sum(n for _, n in scheduled), lane=lane)
        if not scheduled:
            return plan  # not executed: finished ids wait
        plan.finished_request_ids, self._finished_ids = self._finished_ids, []
        plan.preempted_request_ids, self._preempted_ids = self._preempted_ids, []
        if lane is None and self.splits is not None:
            self._long.update(req.request_id for req, _ in scheduled if self._long_prompt(req))
        for req, n in scheduled:
            if req.num_blocks_sent == 0:
                plan.new_requests.append(req.runner_state())
            plan.seqs.append(self._describe(req, n))
            # later plans build on them (proposals count once accepted)
            req.num_computed_tokens += n - len(self._proposals.get(req.request_id, ()))
            if req.num_computed_tokens == req.num_tokens_with_pending:
                req.num_pending += 1
        self._in_flight[plan.step_id] = scheduled
        if self.splits is not None:
            self._blocks_of[plan.step_id] = [self.kv.blocks_of(req.request_id) for req, _ in scheduled]
        if lane == "prefill":
            self.in_prefill_lane, self._prefill_step = {req.request_id for req, _ in scheduled}, plan.step_id
            self._long.update(self.in_prefill_lane)
            decodes = StepShape.of((r.num_computed_tokens, 1) for r in self._decoders())
            if not decodes.num_tokens and not self._decode_lane_idle():
                decodes = StepShape(1, 1)
            self.split = self.splits.choose(decodes, True)
        self._proposals = {}
        return plan

    def speculating(self, decoding: list[Request] | None = None) -> bool:
        """If so the engine lands the step in flight first: proposals need each last token.
        Decoding: every known token computed, or all but one."""
        if self.spec is None:
            return False
        if self._speculate is None:  # kept until the plan or a landed step
            self._speculate = self.spec.worth_it(self._decoding() if decoding is None else decoding)
        return self._speculate

    def _decoding(self) -> list[Request]:
        return [r for r in self.running.values() if r.num_computed_tokens >= r.num_tokens - 1]

    def _head(self, lane: str | None) -> Request | None:
        """The first waiting request, if it can start this step."""
        head = self._peek_waiting()
        return head if head is not None and self._can_seat(head) and self._admissible(head, lane) else None

    def _schedule(self, lane: str | None = None) -> list[tuple[Request, int]]:
        head = self._head(lane)
        speculate = False
        if self.spec is not None:
            decoding = self._decoding()  # once a step
            speculate = self.speculating(decoding)
            self._speculate = None
            self.spec.decided(decoding, speculate)  # off: a shadow keeps the acceptance rate measured
        spec_tokens = self.spec.k if speculate else 0
        running = self.running.values() if lane is None else [r for r in self.running.values() if self._in_lane(r, lane)]
        budget = self.policy.step_budget(head, running, self._waiting_by_lane, self.clock(), spec_tokens)
        scheduled, preempted = self._schedule_running(budget, speculate, lane)
        if not preempted:
            self._admit(scheduled, budget, self.config.max_num_seqs, lane)
            if budget.top_up:
                self._top_up(scheduled, budget)
        if not scheduled and head is not None and running:  # the head found no blocks
            budget = self.policy.step_budget(None, running, self._waiting_by_lane, self.clock(), spec_tokens)
            scheduled, _ = self._schedule_running(budget, speculate, lane)
        return scheduled

    def _schedule_prefill_lane(self) -> list[tuple[Request, int]]:
        """Long prompts: full steps beside other work, else a lone step."""
        top = self.config.max_num_batched_tokens
        head = self._head("prefill")
        if self._decoders() or not self._decode_lane_idle():
            budget = StepBudget(top, top, dict.fromkeys(LANES, top))
        else:
            running = [r for r in self.running.values() if self._in_lane(r, "prefill")]
            budget = self.policy.step_budget(head, running, self._waiting_by_lane, self.clock())
        scheduled, preempted = self._schedule_running(budget, lane="prefill")
        if not preempted:
            self._admit(scheduled, budget, self.config.max_num_seqs, "prefill")
        return scheduled

    def _long_prompt(self, req: Request) -> bool:
        return req.num_tokens - req.num_computed_tokens > self.policy.prefill_cap

    def _admissible(self, req: Request, lane: str | None) -> bool:
        return lane is None or self._long_prompt(req) == (lane == "prefill")

    def prefill_lane_only(self) -> bool:
        """Only long prompts, none decoding yet: nothing to protect."""
        return not self.in_prefill_lane and not self._decoders() and self._decode_lane_idle()

    def _decode_lane_idle(self) -> bool:
        """No short prompt waits or runs."""
        return (all(self._in_lane(r, "prefill") or r.request_id in self.in_prefill_lane
                    or r.num_tokens_with_pending - r.num_computed_tokens <= 1 for r in self.running.values())
                and all(self._long_prompt(r) for _, r in self._waiting if not r.is_finished))

    def _decoders(self) -> list[Request]:
        return [r for r in self._preemptible() if r.num_tokens_with_pending - r.num_computed_tokens == 1]

    def _in_lane(self, req: Request, lane: str | None) -> bool:
        if lane is None:
            return True
        rid = req.request_id
        long = rid in self._long and req.num_tokens_with_pending - req.num_computed_tokens > 1
        return rid not in self.in_prefill_lane and long == (lane == "prefill")

    def _schedule_running(self, budget: StepBudget, speculate: bool = False, lane: str | None = None
                          ) -> tuple[list[tuple[Request, int]], bool]:
        """Running requests in policy order, preempting from the lowest-ranked end."""
        scheduled: list[tuple[Request, int]] = []
        preempted = False
        now = self.clock()
        order = self.policy.order_running(self._preemptible())
        tail = len(order)  # order[i:tail]: not yet scheduled
        i = 0
        while i < tail and budget.tokens > 0:
            req = order[i]
            i += 1
            if (req.num_pending and req.will_finish_by_length()) or not self._in_lane(req, lane):
                continue
            if self.policy.steps_aside(req, budget, now) or not self._lora_fits(req):
                continue
            if self._crosses_rope_length(req):
                if not req.num_pending:
                    self._preempt(req, restart=True)
                continue
            wanted = req.num_tokens_with_pending - req.num_computed_tokens
            proposals = self._propose(req, budget) if speculate else []
            n = budget.take(req, wanted + len(proposals))
            if wanted > 1:
                n = min(n, budget.running_prefill)
            if n == 0:
                continue
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
                budget.spend(req, n)
                if req.lora_id:
                    self._step_loras.add(req.lora_id)
                if wanted > 1:
                    budget.running_prefill -= n
                if proposals:
                    self._proposals[req.request_id] = proposals
        return scheduled, preempted

    def _propose(self, req: Request, budget: StepBudget) -> list[int]:
        k = min(self.spec.max_tokens_for(req), budget.take(req, 1 << 30) - 1)
        if self.rope_restart_at and req.rope_length <= self.rope_restart_at:
            k = min(k, self.rope_restart_at - req.num_tokens_with_pending)
        return self.spec.propose(req, k) if k > 0 else []

    def _lora_fits(self, req: Request) -> bool:
        """Its adapter is ready, with a slot in this step."""
        if self.lora_ready is not None and req.lora_id and req.lora_id not in self.lora_ready:
            self.lora_wanted[req.lora_id] = None
            return False
        loras = self._step_loras
        return not req.lora_id or req.lora_id in loras or len(loras) < self.max_loras

    def _admit(self, scheduled: list[tuple[Request, int]], budget: StepBudget, max_running: int,
               lane: str | None = None) -> None:
        """Waiting requests in policy order; one without an adapter slot (or lane) is passed over."""
        passed: list[tuple[tuple, Request]] = []
        try:
            self._admit_waiting(scheduled, budget, max_running, passed, lane)
        finally:
            for entry in passed:
                heapq.heappush(self._waiting, entry)

    def _admit_waiting(self, scheduled: list[tuple[Request, int]], budget: StepBudget, max_running: int,
                       passed: list[tuple[tuple, Request]], lane: str | None = None) -> None:
        while budget.tokens > 0:
            req = self._peek_waiting()
            if req is None or req.num_pending:
                break  # a preempted request waits for its in-flight token
            if not self._lora_fits(req) or not self._admissible(req, lane):
                passed.append(heapq.heappop(self._waiting))
                continue
            if len(self.running) >= max_running:
                if not self._make_room(req, scheduled, budget):
                    break
                continue
            # a cached prefix has no logits to score
            cached = self.kv.find_cached_prefix(req) if req.takes_prefix_hit else []
            num_cached = len(cached) * self.kv.block_size
            n = budget.take(req, req.num_tokens - num_cached)
            if n == 0:
                break
            if not self.kv.allocate_slots(req, n, cached):
                if not self._make_room(req, scheduled, budget):
                    break  # later requests do not overtake the head
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
            budget.spend(req, n)
            if req.lora_id:
                self._step_loras.add(req.lora_id)

    def _can_seat(self, req: Request) -> bool:
        return len(self.running) < self.config.max_num_seqs or self.policy.victim(req, self._preemptible()) is not None

    def _preemptible(self) -> Collection[Request]:
        if not self.in_prefill_lane:
            return self.running.values()
        return [r for r in self.running.values() if r.request_id not in self.in_prefill_lane]

    def _make_room(self, req: Request, scheduled: list[tuple[Request, int]], budget: StepBudget) -> bool:
        """Preempt the policy's victim for `req`, out of this step too; False if none."""
        victim = self.policy.victim(req, self._preemptible())
        if victim is None:
            return False
        for i, (r, n) in enumerate(scheduled):
            if r is victim:
                del scheduled[i]
                budget.spend(victim, -n)
                break
        self._preempt(victim)
        return True

    def _top_up(self, scheduled: list[tuple[Request, int]], budget: StepBudget) -> None:
        for i, (req, n) in enumerate(scheduled):
            if budget.tokens == 0:
                break
            extra = min(req.num_tokens_with_pending - req.num_computed_tokens - n, budget.tokens)
            if extra > 0 and self.kv.allocate_slots(req, n + extra):
                scheduled[i] = (req, n + extra)
                budget.tokens -= extra

    def _describe(self, req: Request, n: int) -> ScheduledSeq:
        start = req.num_computed_tokens
        proposals = self._proposals.get(req.request_id, [])
        if proposals:  # a decode with its last token known
            new_blocks = self.kv.block_ids(req.request_id, req.num_blocks_sent)
            req.num_blocks_sent += len(new_blocks) // self.kv.num_groups
            return ScheduledSeq(req.request_id, [req.all_token_ids[start], *proposals], start, new_blocks, True,
                                num_spec_tokens=len(proposals), draft_token_ids=self.spec.catch_up(req, start))
        known = req.all_token_ids[start:start + n]
        new_blocks = self.kv.block_ids(req.request_id, req.num_blocks_sent)
        req.num_blocks_sent += len(new_blocks) // self.kv.num_groups
        seq = ScheduledSeq(
            request_id=req.request_id,
            token_ids=known if len(known) == n else known + [0],
            start_pos=start,
            new_block_ids=new_blocks,
            sample=start + n == req.num_tokens_with_pending,
            from_previous=len(known) < n,
        )
        if req.needs_prompt_logprobs:  # positions [first, end) score the next prompt token
            first = max(start, req.num_prompt_logprobs_scheduled)
            end = min(start + n, req.num_prompt_tokens - 1)
            if end > first:
                seq.prompt_logprobs_from = first - start
                seq.prompt_logprob_targets = req.prompt_token_ids[first + 1:end + 1]
                req.num_prompt_logprobs_scheduled = end
        return seq

    def _crosses_rope_length(self, req: Request) -> bool:
        return 0 < req.rope_length <= self.rope_restart_at < req.num_tokens_with_pending

    def _preempt(self, req: Request, restart: bool = False) -> None:
        """`restart`: for `rope_restart_at`, not memory; its RoPE length becomes the sequence's."""
        # a step in flight may still write them: the next owner writes after
        del self.running[req.request_id]
        self._long.discard(req.request_id)
        self.kv.free(req)
        req.num_computed_tokens = req.num_draft_computed = 0
        if req.num_blocks_sent:
            req.num_blocks_sent = 0
            self._preempted_ids.append(req.request_id)
        if restart:
            req.rope_length = req.num_tokens
            self.kv.forget_hashes(req.request_id)
        else:
            req.num_preemptions += 1
            self.num_preemptions += 1
        self._push_waiting(req)

    def update(self, plan: StepPlan, sampled: dict[str, int],
               logprobs: dict[str, dict[int, float]] | None = None,
               prompt_logprobs: dict[str, ScoredPrompt] | None = None,
               pooled: dict[str, list[float]] | None = None) -> list[EngineCoreOutput]:
        """A request finished since ignores its token. A pooling request finishes with its vector."""
        self._speculate = None  # who decodes, and acceptance, change
        now = self.clock()
        outputs = []
        proposed = {s.request_id: s.num_spec_tokens for s in plan.seqs if s.num_spec_tokens}
        landed = self._in_flight.pop(plan.step_id, ())
        if self.splits is not None:
            self._lane_landed(plan, landed)
        for req, _ in landed:
            if prompt_logprobs and (scored := prompt_logprobs.get(req.request_id)) is not None:
                if req.prompt_logprobs is None:
                    req.prompt_logprobs = scored
                else:
                    req.prompt_logprobs.extend(scored)
            if pooled and (vector := pooled.get(req.request_id)) is not None:
                req.num_pending -= 1
                if not req.is_finished:
                    outputs.append(self._pooled(req, vector, now))
                continue
            token = sampled.get(req.request_id)
            if token is None:
                continue
            req.num_pending -= 1
            if req.is_finished:
                continue
            tokens = [token] if isinstance(token, int) else token  # a verified speculation: 1 to k + 1 tokens
            if req.request_id in proposed:
                self.spec.verified(req, proposed[req.request_id], len(tokens) - 1)
            for i, token in enumerate(tokens):
                req.append_token(token)
                if req.finish_reason is not None:
                    tokens = tokens[:i + 1]
                    break
            if self.spec is not None:
                self.spec.observe_tokens(req)
            # accepted proposals' KV is cached; a rejected one's slot is overwritten next step
            req.num_computed_tokens += len(tokens) - 1
            first = req.first_token_time is None
            if first:
                req.first_token_time = now
            lp = logprobs.get(req.request_id) if logprobs else None
            out = EngineCoreOutput(req.request_id, tokens, num_cached_tokens=req.num_cached_tokens,
                                   new_logprobs=None if lp is None else [lp])
            if first:
                out.first_scheduled_time, out.first_token_time = req.first_scheduled_time, now
                if req.sampling_params.prompt_logprobs is not None:
                    out.prompt_logprobs, req.prompt_logprobs = req.prompt_logprobs or ScoredPrompt(), None
            if req.finish_reason is not None:
                self._finish(req, now)
                out.finish_reason, out.stop_reason, out.finished_time = req.finish_reason, req.stop_reason, now
            outputs.append(out)
        return outputs

    def _lane_landed(self, plan: StepPlan, landed: list[tuple[Request, int]]) -> None:
        if plan.step_id == self._prefill_step:
            self.in_prefill_lane, self._prefill_step = set(), None
            self.split = self.splits.whole(decode=True)
        for (req, _), seq, blocks in zip(landed, plan.seqs, self._blocks_of.pop(plan.step_id, ())):
            self.kv.publish_landed(req, seq.start_pos + len(seq.token_ids), blocks)
        self.kv.pool.landed(plan.step_id)

    def _pooled(self, req: Request, vector: list[float], now: float) -> EngineCoreOutput:
        req.first_token_time = now
        req.finish_reason = "stop"
        self._finish(req, now)
        return EngineCoreOutput(req.request_id, [], "stop", num_cached_tokens=req.num_cached_tokens,
                                first_scheduled_time=req.first_scheduled_time, first_token_time=now,
                                finished_time=now, pooled=vector)

    def _finish(self, req: Request, now: float) -> None:
        was_running = req.status is RequestStatus.RUNNING
        req.status = RequestStatus.FINISHED
        self._long.discard(req.request_id)
        if was_running:
            del self.running[req.request_id]
        else:
            self._num_waiting -= 1
            self._waiting_by_lane[req.lane] -= 1
        self.kv.free(req)
        del self.requests[req.request_id]
        self._finished_ids.append(req.request_id)

    def abort(self, request_ids: list[str]) -> list[EngineCoreOutput]:
        self._speculate = None
        now = self.clock()
        outputs = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None:
                continue
            req.finish_reason = "abort"
            self._finish(req, now)
            outputs.append(EngineCoreOutput(rid, [], finish_reason="abort", finished_time=now,
                                            num_cached_tokens=max(req.num_cached_tokens, 0)))
        return outputs
