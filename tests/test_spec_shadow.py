"""While prompt lookup is off, the scheduler measures its acceptance rate on one request at a
time (a shadow proposal checked against the tokens decoded plainly), so the step-cost model
can turn speculation on once it pays (simulated steps, no model)."""

import random

from expresslane.config import SchedulerConfig, SpeculativeConfig
from expresslane.engine.contract import EngineCoreRequest
from expresslane.engine.cost_model import StepCostModel
from expresslane.engine.kv_cache import KVCacheManager
from expresslane.engine.request import Request
from expresslane.engine.scheduler import Scheduler
from expresslane.engine.spec_decode import PRIOR_ACCEPTANCE, SpecDecoder
from expresslane.sampling_params import SamplingParams

PATTERN = [11, 12, 13, 14, 15, 16]
# a plain step 1 ms; a verify step of 1 + 4 tokens 1.9 ms (the mixed-step constant): at the prior
# acceptance (0.5: 1.94 tokens a verify) speculating costs 0.98 ms a token, more than 0.9 x plain;
# at an acceptance of 1 (5 tokens a verify) 0.38 ms
COSTS = StepCostModel([1, 16], [1e-3, 1e-3], c_mixed=0.9e-3)


def run(next_token, steps: int, prompt=PATTERN * 4):
    spec = SpecDecoder(SpeculativeConfig(speculative_method="ngram", num_speculative_tokens=4), COSTS)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=8), KVCacheManager(1000, 16),
                      clock=lambda: 0.0, cost_model=COSTS, spec=spec)
    req = Request.from_core_request(EngineCoreRequest(
        "r", list(prompt), SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True), (0,), 0.0, 0,
        "interactive"), 4096)
    sched.add_request(req)
    speculated = []
    for _ in range(steps):
        plan = sched.schedule()
        [seq] = plan.seqs
        speculated.append(seq.num_spec_tokens)
        n = seq.num_spec_tokens + 1 if seq.num_spec_tokens else 1
        tokens = []
        for _ in range(n):
            tokens.append(next_token(req.all_token_ids + tokens))
        sched.update(plan, {"r": tokens if seq.num_spec_tokens else tokens[0]} if seq.sample else {})
    return spec, speculated


def repeat(tokens):  # the model's next token continues the pattern: every proposal right
    return PATTERN[len(tokens) % len(PATTERN)]


def test_shadow_proposals_measure_acceptance_and_turn_speculation_on():
    spec, speculated = run(repeat, 120)
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
