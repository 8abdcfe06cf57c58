"""While prompt lookup is off, the scheduler measures its acceptance rate on one request at a
time (a shadow proposal checked against the tokens decoded plainly), so the step-cost model
can turn speculation on once it pays (simulated steps, no model)."""

import random
from pathlib import Path

import pytest
import torch

import expresslane
from expresslane.config import SchedulerConfig, SpeculativeConfig
from expresslane.contract import EngineCoreRequest
from expresslane.cost_model.base import StepCostModel
from expresslane.cost_model.piecewise import PiecewiseStepCostModel
from expresslane.scheduler.kv_cache import KVCacheManager
from expresslane.scheduler.request import Request
from expresslane.scheduler.scheduler import Scheduler
from expresslane.runner.proposer_registry import make_proposer
from expresslane.scheduler.spec_decode import SpecDecoder
from expresslane.sampling_params import SamplingParams

_TUNING = SpeculativeConfig()
PRIOR_ACCEPTANCE, PRIOR_UNTIL = _TUNING.speculative_prior_acceptance, _TUNING.speculative_prior_until
PROBE_EVERY, PROBE_EVERY_MEASURED = _TUNING.speculative_probe_every, _TUNING.speculative_probe_every_measured
WARMUP_VERIFIES = _TUNING.speculative_warmup_verifies
DRAFT = Path(expresslane.__file__).parent / "models" / "data" / "stdlib-llama-2m-draft"
PATTERN = [11, 12, 13, 14, 15, 16]
# a plain step 1 ms; a verify step of 1 + 4 tokens 1.9 ms (the mixed-step constant): at the prior
# acceptance (0.5: 1.94 tokens a verify) speculating costs 0.98 ms a token, more than 0.9 x plain;
# at an acceptance of 1 (5 tokens a verify) 0.38 ms
COSTS = PiecewiseStepCostModel([1, 16], [1e-3, 1e-3], c_mixed=0.9e-3)


def spec_decoder(costs: StepCostModel = COSTS, **kwargs) -> SpecDecoder:
    """The scheduler's side of speculative decoding with the proposer the engine builds (a draft
    model: the built-in one, on the CPU)."""
    config = SpeculativeConfig(**kwargs)
    return SpecDecoder(config, costs, make_proposer(config, 8192, torch.device("cpu"), torch.float32, "torch"))


def run(next_token, steps: int, prompt=PATTERN * 4, pipelined: bool = False):
    """`pipelined`: as the engine on a GPU, each plan is made while the step before is in flight
    (its token not yet known), except when a speculative step is involved."""
    spec = spec_decoder(speculative_method="ngram", num_speculative_tokens=4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=8), KVCacheManager(1000, 16),
                      clock=lambda: 0.0, cost_model=COSTS, spec=spec)
    req = Request.from_core_request(EngineCoreRequest(
        "r", list(prompt), SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True), (0,), 0.0, 0,
        "interactive"), 4096)
    sched.add_request(req)

    def land(plan):
        [seq] = plan.seqs
        tokens = []
        for _ in range(seq.num_spec_tokens + 1):
            tokens.append(next_token(req.all_token_ids + tokens))
        sched.update(plan, {"r": tokens if seq.num_spec_tokens else tokens[0]} if seq.sample else {})

    speculated, in_flight = [], None
    for _ in range(steps):
        if in_flight is not None and (not pipelined or in_flight.seqs[0].num_spec_tokens or sched.speculating()):
            land(in_flight)
            in_flight = None
        plan = sched.schedule()
        speculated.append(plan.seqs[0].num_spec_tokens)
        if in_flight is not None:
            land(in_flight)
        in_flight = plan
    land(in_flight)
    return spec, speculated


def repeat(tokens):  # the model's next token continues the pattern: every proposal right
    return PATTERN[len(tokens) % len(PATTERN)]


@pytest.mark.parametrize("pipelined", [False, True])
def test_shadow_proposals_measure_acceptance_and_turn_speculation_on(pipelined):
    """Pipelined: the request always has a token in flight while the next step is planned (on
    the H200 the shadow then never proposed, and the acceptance stayed on the prior)."""
    spec, speculated = run(repeat, 120, pipelined=pipelined)
    assert speculated[1] == 0  # the first decodes: the prior says it does not pay
    first = next(i for i, k in enumerate(speculated) if k)
    assert spec.shadow_proposed >= 64 and spec.shadow_accepted == spec.shadow_proposed
    assert first > 1 and all(k == 4 for k in speculated[first:-1])  # on from then: each verify accepts all
    assert spec.counters.num_draft_tokens == sum(speculated)  # /metrics count verified proposals only
    assert spec.counters.num_accepted_tokens == spec.counters.num_draft_tokens > 0


def test_shadow_proposals_that_miss_keep_it_off():
    """Tokens drawn at random from the pattern's six: n-grams recur (proposals), continuations
    rarely match."""
    spec, speculated = run(lambda tokens: random.Random(len(tokens)).choice(PATTERN), 300)
    assert not any(speculated)
    assert spec.shadow_proposed >= 64 and spec.acceptance() < 0.3 < PRIOR_ACCEPTANCE


def _decoding(n: int) -> list[Request]:
    return [Request.from_core_request(EngineCoreRequest(
        f"r{i}", list(PATTERN), SamplingParams(temperature=0.0), (0,), 0.0, 0, "interactive"), 4096)
        for i in range(n)]


def test_a_verify_steps_first_use_cost_does_not_keep_speculation_off():
    """The first verify step on the H200 measured ~245x its prediction (Triton compiling the
    verify shapes); a moving average turned speculation off for good after it. Sustained slow
    verifies still do."""
    def decoder(ratios):
        spec = spec_decoder(speculative_method="ngram", num_speculative_tokens=4)
        spec.shadow_proposed = spec.shadow_accepted = 100  # every proposal right: speculating pays
        for r in ratios:
            spec.observe(r * 1.9e-3, [(5, 5, 4)])  # one seq verifying 4 proposals: predicted 1.9 ms
        return spec

    decoding = _decoding(1)
    assert decoder([1.0] * 12).worth_it(decoding)
    first_use = decoder([245.0] + [1.1] * 3 + [1.1] * 8 + [245.0])  # a later outlier: one of the window
    assert first_use.verify_scale(1) == 1.1 and first_use.worth_it(decoding)
    assert not decoder([1.0] * 4 + [3.0] * 12).worth_it(decoding)  # 3x steadily: 1.1 ms a token against 1 plain


def test_verify_cost_is_measured_per_batch_size():
    """On the H200 a verify step of the 9M model cost ~1.2x its prediction alone and ~20x at batch 64
    (eager there): one scale for both kept speculating at 64 for 160 verify steps (0.45x plain).
    Slow verifies at batch 64 turn it off at 64 and not at 1; an unmeasured size takes the nearest
    smaller measured one's scale."""
    spec = spec_decoder(speculative_method="ngram", num_speculative_tokens=4)
    spec.shadow_proposed = spec.shadow_accepted = 100
    for _ in range(8):
        spec.observe(1.9e-3, [(5, 5, 4)])
        spec.observe(20 * 1.9e-3, [(5, 5, 4)] * 64)  # (the flat model: 64 x 5 tokens cost as 5)
    assert spec.verify_scale(1) == 1.0 and spec.verify_scale(64) == 20.0 and spec.verify_scale(100) == 20.0
    assert spec.verify_scale(8) == 1.0  # not measured: batch 1's
    assert spec.worth_it(_decoding(1)) and not spec.worth_it(_decoding(64))


def test_a_verify_step_is_predicted_no_cheaper_than_the_plain_step_it_extends():
    """A mixed-step constant fitted negative (host-bound GPU runs fitted -0.95 ms) made a 5-token
    step's prediction 0: speculating looked free, and its measurements (over 0) were dropped."""
    costs = PiecewiseStepCostModel([1, 16], [1e-3, 1.1e-3], c_mixed=-2e-3)
    spec = spec_decoder(costs, speculative_method="ngram", num_speculative_tokens=4)
    spec.shadow_proposed = spec.shadow_accepted = 100
    plain, speculating = spec.predicted_costs([5])
    assert plain == 1e-3 and speculating == 1e-3 / 5  # the plain step's time, over 5 tokens a verify
    for _ in range(WARMUP_VERIFIES + 1):
        spec.observe(6e-3, [(5, 5, 4)])
    assert spec.verify_scale(1) == 6.0 and not spec.worth_it(_decoding(1))


def test_a_draft_model_probes_while_its_acceptance_is_the_prior():
    """No shadow for a draft model (its proposals cost a forward): while the prior (0.5) says
    speculating does not pay, one step in PROBE_EVERY speculates anyway, the same answer both
    times a step asks; once PRIOR_UNTIL tokens were proposed the model decides, with a probe in
    PROBE_EVERY_MEASURED steps where speculating would pay at full acceptance."""
    spec = spec_decoder(speculative_model=str(DRAFT), num_speculative_tokens=4)
    decoding = _decoding(1)
    decisions = []
    for _ in range(3 * PROBE_EVERY):
        speculate = spec.worth_it(decoding)
        assert spec.worth_it(decoding) == speculate  # the engine's question, then the plan's
        spec.decided(decoding, speculate)
        decisions.append(speculate)
    assert decisions == ([False] * PROBE_EVERY + [True]) * 2 + [False] * (PROBE_EVERY - 2)
    spec.record(PRIOR_UNTIL, PRIOR_UNTIL // 8)  # measured: 1 in 8 accepted (1.1 tokens a verify)
    decisions = []
    for _ in range(2 * PROBE_EVERY_MEASURED):  # (PROBE_EVERY - 2 steps off already)
        speculate = spec.worth_it(decoding)
        spec.decided(decoding, speculate)
        decisions.append(speculate)
    # the measured rate says no; a probe now and then re-measures it (a few early verifies are not final)
    first = PROBE_EVERY_MEASURED - (PROBE_EVERY - 2)
    assert [i for i, d in enumerate(decisions) if d] == [first, first + PROBE_EVERY_MEASURED + 1]
    # where speculating could not pay even at full acceptance (verify steps measured 10x dearer), none
    for _ in range(WARMUP_VERIFIES + 1):
        spec.observe(10 * 1.9e-3, [(5, 5, 4)])
    for _ in range(2 * PROBE_EVERY_MEASURED):
        assert not spec.worth_it(decoding)
        spec.decided(decoding, False)


def _scheduler(spec: SpecDecoder, num_requests: int, max_tokens: int, budget: int, max_seqs: int,
               blocks: int) -> tuple[Scheduler, list[Request]]:
    """A scheduler with `spec` and `num_requests` greedy requests r0.. of the repeating pattern."""
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs),
                      KVCacheManager(blocks, 16), clock=lambda: 0.0, cost_model=COSTS, spec=spec)
    reqs = [Request.from_core_request(EngineCoreRequest(
        f"r{i}", PATTERN * 4, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True), (0,), 0.0,
        0, "interactive"), 4096) for i in range(num_requests)]
    for req in reqs:
        sched.add_request(req)
    return sched, reqs


def run_batch(num_requests: int, max_rows: int | None, steps: int = 40) -> list[list[int]]:
    """`num_requests` requests that speculate whenever allowed (`speculative_disable_by_batch_size`
    above their number), their verify steps' logits rows capped at `max_rows` (the mixed graphs'
    as the engine sets it; None: no graphs). Each plan's proposals per speculating seq."""
    spec = spec_decoder(speculative_method="ngram", num_speculative_tokens=4, speculative_disable_by_batch_size=64)
    spec.max_rows = max_rows
    sched, reqs = _scheduler(spec, num_requests, 400, budget=512, max_seqs=32, blocks=2000)
    by_id = {r.request_id: r for r in reqs}
    plans = []
    for _ in range(steps):
        plan = sched.schedule()
        plans.append([s.num_spec_tokens for s in plan.seqs if s.num_spec_tokens])
        sampled = {}
        for s in plan.seqs:
            if s.sample:
                tokens = by_id[s.request_id].all_token_ids
                sampled[s.request_id] = ([repeat(tokens + [0] * j) for j in range(s.num_spec_tokens + 1)]
                                         if s.num_spec_tokens else repeat(tokens))
        sched.update(plan, sampled)
    return plans


def test_verify_rows_fit_the_graphs_and_speculation_stops_past_half_of_them():
    """On the H200 a verify step whose logits rows (each speculating request's token and its
    proposals) outnumbered the mixed graph's ran eagerly, ~20x its prediction at batch 64: the
    first verifies of that batch size cost the run 15%. The proposals per request now shrink so
    the rows fit; with no room for one proposal each, no step speculates."""
    free = run_batch(4, None)
    assert max(max(p, default=0) for p in free) == 4  # no graphs: the configured 4
    fitted = run_batch(4, 16)
    assert max(max(p, default=0) for p in fitted) == 3 and any(fitted)  # 4 x (1 + 3) = 16 rows
    assert all(sum(k + 1 for k in p) <= 16 for p in fitted)
    assert not any(run_batch(9, 16))  # 16 // 9 - 1 = 0 proposals: off


def test_the_decision_is_made_once_until_something_changes():
    """Every held engine call asks `speculating()` (up to 1 kHz while a long step runs), the
    engine asks it before planning and the plan again: one evaluation serves them all until a
    step lands (tokens change who decodes and the acceptance rate) or a request is aborted."""
    spec = spec_decoder(speculative_method="ngram", num_speculative_tokens=4)
    sched, _ = _scheduler(spec, 2, 50, budget=256, max_seqs=8, blocks=1000)
    asked, real = [], spec.worth_it
    spec.worth_it = lambda decoding: asked.append(len(decoding)) or real(decoding)
    plan = sched.schedule()  # the prompts
    sched.update(plan, {s.request_id: 1 for s in plan.seqs})
    before = len(asked)
    for _ in range(5):
        sched.speculating()
    plan = sched.schedule()
    assert len(asked) == before + 1 and asked[-1] == 2
    sched.update(plan, {s.request_id: 1 for s in plan.seqs})
    sched.speculating()
    sched.abort(["r1"])
    sched.speculating()
    assert len(asked) == before + 3 and asked[-1] == 1


def test_a_draft_models_probe_speculates_with_one_request_in_turn():
    """A probe measures the draft's acceptance, which does not depend on the batch. On the H200
    probes of all 64 requests of a batch cost ~10x a step each (each request's draft first
    caught up on its tokens), and the run went at 0.72x of no speculation. Now one request
    speculates in a probe step, each in turn, with the proposals one request may make."""
    spec = spec_decoder(speculative_model=str(DRAFT), num_speculative_tokens=4)
    sched, _ = _scheduler(spec, 4, 400, budget=512, max_seqs=8, blocks=2000)
    probes = []
    for step in range(4 * PROBE_EVERY + 5):
        plan = sched.schedule()
        speculating = [(s.request_id, s.num_spec_tokens) for s in plan.seqs if s.num_spec_tokens]
        if step:  # after the prompts' step: all four decode
            assert len(plan.seqs) == 4
        if speculating:
            probes.append(speculating)
        sched.update(plan, {s.request_id: [1] * (s.num_spec_tokens + 1) if s.num_spec_tokens else 1
                            for s in plan.seqs if s.sample})
    assert len(probes) == 4  # the prior (0.5) says no: a probe every PROBE_EVERY + 1 steps
    assert all(len(p) == 1 and p[0][1] == 4 for p in probes)
    assert sorted(p[0][0] for p in probes) == ["r0", "r1", "r2", "r3"]
