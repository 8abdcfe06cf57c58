"""Whether a step speculates, with how many proposals each."""

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
    """For /metrics (vLLM's spec_decode_* counters)."""

    num_drafts: int = 0  # verifies of a request with at least one proposal
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, cost_model: StepCostModel | None, proposer: Proposer):
        self.config = config
        self.cost_model = cost_model
        self.proposer = proposer
        self.counters = SpecCounters()
        self.draft_cost_ratio = 0.0
        self.max_rows: int | None = None  # a verify's logits rows that fit a graph
        self.k = config.num_speculative_tokens  # this step's proposals per request
        # per batch bucket: verify time measured / predicted
        self._verify_ratios: dict[int, deque[float]] = {}
        self._verify_scales: dict[int, float] = {}
        self._verifies_seen: dict[int, int] = {}
        self._shadow: tuple[Request, int, list[int]] | None = None  # (request, at, proposal)
        self._shadow_turn = 0
        self.shadow_proposed = self.shadow_accepted = 0
        self._probe: Request | None = None
        self._probe_turn = 0
        self._steps_off = 0  # planned steps since one speculated

    @property
    def proposes_on_host(self) -> bool:
        return self.proposer.proposes_on_host

    def _on_prior(self) -> bool:
        return self.counters.num_draft_tokens + self.shadow_proposed < self.config.speculative_prior_until

    def acceptance(self) -> float:
        """Accepted over proposed tokens, verified and shadowed, past the prior."""
        if self._on_prior():
            return self.config.speculative_prior_acceptance
        c = self.counters
        return (c.num_accepted_tokens + self.shadow_accepted) / (c.num_draft_tokens + self.shadow_proposed)

    def proposals(self, num_decoding: int) -> int:
        """Proposals per request that keep the verify rows within `max_rows`."""
        k = self.config.num_speculative_tokens
        if self.max_rows is not None:
            k = min(k, self.max_rows // max(1, num_decoding) - 1)
        return max(0, k)

    def decided(self, decoding: list[Request], speculate: bool) -> None:
        """Its `k`, a probe's request, or a shadow."""
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
        """Off: take a request's host proposal as if speculating."""
        if not self.proposes_on_host or not decoding:
            return
        if self._shadow is not None:
            if not self._shadow[0].is_finished:
                return
            self._shadow = None
        req = decoding[self._shadow_turn % len(decoding)]
        self._shadow_turn += 1
        k = self._allowed(req)
        proposal = self.propose(req, k) if k > 0 else []
        if proposal:
            self._shadow = (req, req.num_tokens, proposal)

    def observe_tokens(self, req: Request) -> None:
        """Count a shadow's matches once its tokens are in."""
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
        if req.num_pending or req.num_computed_tokens != req.num_tokens - 1:
            return 0
        return self._allowed(req)

    def _allowed(self, req: Request) -> int:
        """None with logprobs, below min_tokens or seeded sampling."""
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
        return self.proposer.catch_up(req.all_token_ids, req.num_draft_computed, start)

    def verified(self, req: Request, proposed: int, accepted: int) -> None:
        self.record(proposed, accepted)
        req.num_draft_computed = self.proposer.computed_after(req.num_computed_tokens, accepted, proposed)

    def worth_it(self, decoding: list[Request]) -> bool:
        """By batch size if capped, else cost model or probe."""
        if not decoding or not self.proposals(len(decoding)):
            return False
        limit = self.config.speculative_disable_by_batch_size
        if limit is not None:
            return len(decoding) <= limit
        if self.cost_model is None:
            return False
        contexts = [r.num_tokens - 1 for r in decoding]
        return self._pays(contexts) or (not self.proposes_on_host and self._probe_due(contexts))

    def _pays(self, contexts: list[int]) -> bool:
        plain, spec = self.predicted_costs(contexts)
        return spec < self.config.speculative_gain_margin * plain

    def _is_probe(self, decoding: list[Request]) -> bool:
        """Speculating only to measure acceptance."""
        return (not self.proposes_on_host and self.cost_model is not None
                and self.config.speculative_disable_by_batch_size is None
                and not self._pays([r.num_tokens - 1 for r in decoding]))

    def _probe_due(self, contexts: list[int]) -> bool:
        if self._on_prior():
            return self._steps_off >= self.config.speculative_probe_every
        if self._steps_off < self.config.speculative_probe_every_measured:
            return False
        plain, best = self.predicted_costs(contexts, acceptance=1.0)
        return best < self.config.speculative_gain_margin * plain

    def predicted_costs(self, contexts: list[int], acceptance: float | None = None) -> tuple[float, float]:
        """Seconds per generated token of these decodes: plain, speculating."""
        k = self.proposals(len(contexts))
        a = self.acceptance() if acceptance is None else acceptance
        expected = (1 - a ** (k + 1)) / (1 - a) if a < 1 else k + 1.0  # tokens per verify
        n, total = len(contexts), sum(contexts)
        plain = self.cost_model.predict(StepShape(n, total + n))
        spec = self._verify_cost(StepShape(n * (1 + k), 0, (1 + k) * total + n * (1 + k) * (2 + k) // 2, True)
                                 if k else StepShape(n, total + n), plain, k)
        return plain, spec * self.verify_scale(len(contexts)) / expected

    def _verify_cost(self, shape: StepShape, plain: float, k: int) -> float:
        """At least `plain`, with the proposer's `k` steps."""
        predicted = max(self.cost_model.predict(shape), plain)
        return predicted * (1 + k * self.draft_cost_ratio)

    @staticmethod
    def _bucket(num_speculating: int) -> int:
        return num_speculating.bit_length()

    def verify_scale(self, num_speculating: int) -> float:
        """This bucket's, else the nearest smaller's, else 1."""
        measured = [b for b in self._verify_scales if b <= self._bucket(num_speculating)]
        return self._verify_scales[max(measured)] if measured else 1.0

    def observe(self, measured: float, seqs: list[tuple[int, int, int]]) -> None:
        """seqs: (cached tokens, tokens now, proposals)."""
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
