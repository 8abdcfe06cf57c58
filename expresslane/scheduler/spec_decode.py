"""Speculative decoding, the scheduler's side (torch-free): whether a step speculates, with how
many proposals per request, and the acceptance rate that decision needs (docs/architecture.md,
"Speculative decoding"). Proposals come from the `Proposer` (runner/proposer.py).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from expresslane.config import SpeculativeConfig
from expresslane.cost_model.base import StepCostModel, StepShape
from expresslane.runner.proposer import Proposer
from expresslane.scheduler.request import Request



@dataclass(slots=True)
class SpecCounters:
    """Cumulative, for /metrics (vLLM's spec_decode_* counters)."""

    num_drafts: int = 0  # verify steps of a request with at least one proposed token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, cost_model: StepCostModel | None, proposer: Proposer):
        self.config = config
        self.cost_model = cost_model
        self.proposer = proposer
        self.counters = SpecCounters()
        self.draft_cost_ratio = 0.0  # a draft step's time over a target step's (the engine sets it)
        # logits rows a verify step may have and still replay a mixed-step CUDA graph (the engine
        # sets it; None: no graphs). Past it a verify runs eagerly, many times its prediction
        self.max_rows: int | None = None
        self.k = config.num_speculative_tokens  # proposals a request may make in this step (`decided`)
        # per batch bucket (`_bucket`): verify steps' measured time over predicted, the last ones,
        # and their median (kept here: the decision asks for it every step)
        self._verify_ratios: dict[int, deque[float]] = {}
        self._verify_scales: dict[int, float] = {}
        self._verifies_seen: dict[int, int] = {}
        self._shadow: tuple[Request, int, list[int]] | None = None  # (request, at token, proposal)
        self._shadow_turn = 0
        self.shadow_proposed = self.shadow_accepted = 0
        self._probe: Request | None = None  # a probe step's one speculating request (`decided`)
        self._probe_turn = 0
        self._steps_off = 0  # planned steps since the last one that speculated

    @property
    def proposes_on_host(self) -> bool:
        return self.proposer.proposes_on_host

    def _on_prior(self) -> bool:
        return self.counters.num_draft_tokens + self.shadow_proposed < self.config.speculative_prior_until

    def acceptance(self) -> float:
        """Accepted over proposed tokens, verified and shadowed; the prior below self.config.speculative_prior_until proposed."""
        if self._on_prior():
            return self.config.speculative_prior_acceptance
        c = self.counters
        return (c.num_accepted_tokens + self.shadow_accepted) / (c.num_draft_tokens + self.shadow_proposed)

    def proposals(self, num_decoding: int) -> int:
        """Proposals each of `num_decoding` requests may make: `num_speculative_tokens`, fewer
        where their verify rows (the token and its proposals, each) would not fit `max_rows`;
        0 (no speculation) past half of it."""
        k = self.config.num_speculative_tokens
        if self.max_rows is not None:
            k = min(k, self.max_rows // max(1, num_decoding) - 1)
        return max(0, k)

    def decided(self, decoding: list[Request], speculate: bool) -> None:
        """Once a planned step, after its `worth_it`: the step's proposals per request (`k`),
        the steps off (a draft model's probes), a probe's one request and, off, a shadowed
        request (prompt lookup)."""
        self._probe = None
        if speculate and self._is_probe(decoding):
            self._probe = decoding[self._probe_turn % len(decoding)]
            self._probe_turn += 1
        self.k = self.proposals(1 if self._probe is not None else len(decoding))
        if speculate:
            self._steps_off = 0
            return
        self._steps_off += 1
        self.shadow(decoding)

    def shadow(self, decoding: list[Request]) -> None:
        """A step that does not speculate: unless one is pending, take the next decoding
        request's prompt-lookup proposal as if it would speculate (round robin)."""
        if not self.proposes_on_host or not decoding:
            return
        if self._shadow is not None:
            if not self._shadow[0].is_finished:
                return
            self._shadow = None  # finished or aborted before its tokens came
        req = decoding[self._shadow_turn % len(decoding)]
        self._shadow_turn += 1
        k = self._allowed(req)  # a token in flight is fine: the proposal continues the known tokens
        proposal = self.propose(req, k) if k > 0 else []
        if proposal:
            self._shadow = (req, req.num_tokens, proposal)

    def observe_tokens(self, req: Request) -> None:
        """`req` got tokens: once the shadowed one has as many as its proposal, count the matches."""
        if self._shadow is None or self._shadow[0] is not req:
            return
        _, at, proposal = self._shadow
        actual = req.all_token_ids[at:at + len(proposal)]
        if len(actual) < len(proposal):
            if req.finish_reason is not None:
                self._shadow = None
            return
        accepted = next((i for i, (a, b) in enumerate(zip(actual, proposal)) if a != b), len(proposal))
        self.shadow_proposed += len(proposal)
        self.shadow_accepted += accepted
        self._shadow = None

    def max_tokens_for(self, req: Request) -> int:
        """How many tokens ``req`` may propose now (0: it decodes plainly): it must be decoding
        with its last token known (none in flight), and `_allowed` to."""
        if req.num_pending or req.num_computed_tokens != req.num_tokens - 1:
            return 0
        return self._allowed(req)

    def _allowed(self, req: Request) -> int:
        """How many tokens ``req``'s sampling and room allow it to propose: it must want no
        logprobs, be past min_tokens, and have room for the proposals and the target's own token.
        A seeded sampling request never speculates: its tokens must not depend on the batch
        (which steps speculate does). In a probe step only the probed request speculates."""
        if self._probe is not None and req is not self._probe:
            return 0
        sp = req.sampling_params
        if sp.logprobs is not None:
            return 0
        if sp.seed is not None and not sp.greedy:
            return 0
        if req.num_output_tokens < sp.min_tokens:
            return 0
        room = min(req.max_tokens - req.num_output_tokens, req.max_model_len - req.num_tokens) - 1
        return max(0, min(self.k, room))

    def propose(self, req: Request, k: int) -> list[int]:
        return self.proposer.propose(req.all_token_ids, k)

    def catch_up(self, req: Request, start: int) -> list[int]:
        """The tokens before `start` the proposer's cache lacks (`ScheduledSeq.draft_token_ids`)."""
        return self.proposer.catch_up(req.all_token_ids, req.num_draft_computed, start)

    def verified(self, req: Request, proposed: int, accepted: int) -> None:
        """A verify of `req`'s `proposed` tokens accepted `accepted` (before they are appended)."""
        self.record(proposed, accepted)
        req.num_draft_computed = self.proposer.computed_after(req.num_computed_tokens, accepted, proposed)

    def worth_it(self, decoding: list[Request]) -> bool:
        """Whether this step speculates: never when its verify rows could not fit `max_rows`
        with one proposal each; else at most `speculative_disable_by_batch_size` decoding
        requests when that is given; else when the step-cost model predicts less time per
        generated token with k proposals each (at the acceptance rate measured so far), or for
        a draft model's probe. No state changes (`Scheduler.speculating` keeps the answer for the
        engine's question and the plan's until a step lands)."""
        if not decoding or not self.proposals(len(decoding)):
            return False
        limit = self.config.speculative_disable_by_batch_size
        if limit is not None:
            return len(decoding) <= limit
        if self.cost_model is None:
            return False
        contexts = [r.num_tokens - 1 for r in decoding]
        # else a probe: the draft's acceptance is measured by verify steps alone
        return self._pays(contexts) or (not self.proposes_on_host and self._probe_due(contexts))

    def _pays(self, contexts: list[int]) -> bool:
        plain, spec = self.predicted_costs(contexts)
        return spec < self.config.speculative_gain_margin * plain

    def _is_probe(self, decoding: list[Request]) -> bool:
        """Whether a step `worth_it` said yes to speculates only to measure the draft's acceptance."""
        return (not self.proposes_on_host and self.cost_model is not None
                and self.config.speculative_disable_by_batch_size is None
                and not self._pays([r.num_tokens - 1 for r in decoding]))

    def _probe_due(self, contexts: list[int]) -> bool:
        """A draft model's probe: every self.config.speculative_probe_every steps off while on the prior, then every
        self.config.speculative_probe_every_measured where full acceptance would pay."""
        if self._on_prior():
            return self._steps_off >= self.config.speculative_probe_every
        if self._steps_off < self.config.speculative_probe_every_measured:
            return False
        plain, best = self.predicted_costs(contexts, acceptance=1.0)
        return best < self.config.speculative_gain_margin * plain

    def predicted_costs(self, contexts: list[int], acceptance: float | None = None) -> tuple[float, float]:
        """Predicted seconds per generated token (per request) of a step of decodes at these
        context lengths: plain, and speculating k tokens each (with the draft's k steps, at the
        acceptance rate measured so far or `acceptance`, scaled by what verify steps of this
        batch size measured)."""
        k = self.proposals(len(contexts))
        a = self.acceptance() if acceptance is None else acceptance
        expected = (1 - a ** (k + 1)) / (1 - a) if a < 1 else k + 1.0  # tokens per request per step
        n, total = len(contexts), sum(contexts)  # (StepShape.of's sums, without a pass per shape)
        plain = self.cost_model.predict(StepShape(n, total + n))
        spec = self._verify_cost(StepShape(n * (1 + k), 0, (1 + k) * total + n * (1 + k) * (2 + k) // 2, True)
                                 if k else StepShape(n, total + n), plain, k)
        return plain, spec * self.verify_scale(len(contexts)) / expected

    def _verify_cost(self, shape: StepShape, plain: float, k: int) -> float:
        """The model's time for a verify step of this shape, at least `plain` (the same step
        without the proposals), with the draft's `k` steps."""
        predicted = max(self.cost_model.predict(shape), plain)
        return predicted * (1 + k * self.draft_cost_ratio)

    @staticmethod
    def _bucket(num_speculating: int) -> int:
        return num_speculating.bit_length()  # 1 | 2-3 | 4-7 | 8-15 | ...

    def verify_scale(self, num_speculating: int) -> float:
        """Measured over predicted time of verify steps with this many speculating seqs: those of
        its bucket, else of the nearest smaller bucket measured, else 1."""
        measured = [b for b in self._verify_scales if b <= self._bucket(num_speculating)]
        return self._verify_scales[max(measured)] if measured else 1.0

    def observe(self, measured: float, seqs: list[tuple[int, int, int]]) -> None:
        """A verify step's time (completion to completion) and its seqs' (cached tokens, tokens
        now, of them proposals)."""
        bucket = self._bucket(sum(1 for _, _, k in seqs if k))
        self._verifies_seen[bucket] = seen = self._verifies_seen.get(bucket, 0) + 1
        plain = self.cost_model.predict(StepShape.of((start, n - k) for start, n, k in seqs if n > k))
        predicted = self._verify_cost(StepShape.of((start, n) for start, n, _ in seqs), plain,
                                      max(k for _, _, k in seqs))
        if predicted <= 0 or seen <= self.config.speculative_warmup_verifies:
            return
        ratios = self._verify_ratios.setdefault(bucket, deque(maxlen=self.config.speculative_verify_window))
        ratios.append(measured / predicted)
        self._verify_scales[bucket] = float(np.median(ratios))

    def record(self, proposed: int, accepted: int) -> None:
        if proposed:
            self.counters.num_drafts += 1
            self.counters.num_draft_tokens += proposed
            self.counters.num_accepted_tokens += accepted
