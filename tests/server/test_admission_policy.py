"""AdmissionPolicy on its own (no server): sequences and prompt tokens, 400 vs 503, SLO admission."""

from __future__ import annotations

import pytest

from expresslane.server.admission import AdmissionLimits, AdmissionPolicy, Work
from expresslane.server.errors import APIError


def refused(policy: AdmissionPolicy, work: Work) -> APIError | None:
    try:
        policy.check(work)
    except APIError as e:
        return e
    policy.add(work.lane, work.num_seqs, work.num_tokens)
    return None


def test_a_request_counts_prompts_times_n_sequences():
    p = AdmissionPolicy(AdmissionLimits(max_waiting_requests=8))
    assert refused(p, Work("interactive", (5, 7), n=3)) is None  # 6 sequences
    assert (p.waiting_seqs, p.waiting_tokens) == (6, 36)
    e = refused(p, Work("interactive", (5, 5), n=2))  # 4 more: 10 > 8
    assert e.status == 503 and e.code == "overloaded" and "--max-waiting-requests" in e.message
    assert e.headers["Retry-After"] == "1"
    assert refused(p, Work("interactive", (5,), n=2)) is None  # exactly 8
    p.started("interactive", 6, 36)
    assert (p.waiting_seqs, p.waiting_tokens) == (2, 10)


def test_a_request_that_can_never_fit_is_a_400_even_with_nothing_waiting():
    p = AdmissionPolicy(AdmissionLimits(max_waiting_requests=4, max_waiting_tokens=1000))
    e = refused(p, Work("interactive", (3,) * 300, n=128))
    assert e.status == 400 and e.code == "request_too_large"
    assert "38400 sequences" in e.message and "--max-waiting-requests" in e.message
    e = refused(p, Work("interactive", (600,), n=2))  # 1,200 prompt tokens
    assert e.status == 400 and "--max-waiting-tokens" in e.message
    assert p.waiting_seqs == 0


def test_the_token_cap_counts_prompt_tokens_of_every_sequence():
    p = AdmissionPolicy(AdmissionLimits(max_waiting_tokens=100))
    assert refused(p, Work("batch", (30,), n=3)) is None  # 90 tokens
    e = refused(p, Work("batch", (11,), n=1))
    assert e.status == 503 and "prompt tokens" in e.message


def test_a_lane_queue_cap_counts_that_lanes_sequences_only():
    p = AdmissionPolicy(AdmissionLimits(lane_queue={"batch": 2}))
    assert refused(p, Work("batch", (4,), n=2)) is None
    e = refused(p, Work("batch", (4,), n=1))
    assert e.status == 503 and e.code == "lane_queue_full"
    assert refused(p, Work("interactive", (4,), n=50)) is None
    assert refused(p, Work("batch", (4,), n=3)).status == 400  # over the lane's cap on its own


@pytest.mark.parametrize("rate,ahead,own,admitted", [
    (1000.0, 0, 5000, True),  # nothing waiting: admitted whatever its own size
    (1000.0, 100, 50, True),  # 150 tokens at 1000/s = 150 ms < 200 ms
    (1000.0, 150, 100, False),  # 250 ms > 200 ms
    (None, 10_000, 10, True),  # no step seen yet: no estimate, no refusal
])
def test_slo_admission_estimates_the_interactive_prefill_ahead(rate, ahead, own, admitted):
    p = AdmissionPolicy(AdmissionLimits(slo_ttft=0.2))
    if rate is not None:
        p.observe_step(int(rate), 1.0)
    if ahead:
        p.add("interactive", 1, ahead)
    e = refused(p, Work("interactive", (own,), n=1))
    assert (e is None) == admitted
    if e is not None:
        assert e.code == "slo_unattainable" and int(e.headers["Retry-After"]) >= 1
    assert refused(p, Work("batch", (own,), n=1)) is None  # the batch lane has no TTFT promise


def test_the_prefill_rate_is_a_moving_average_of_steps_that_did_work():
    p = AdmissionPolicy(AdmissionLimits())
    p.observe_step(100, 0.1)
    p.observe_step(0, 0.1)  # an empty turn says nothing
    assert p.prefill_rate == pytest.approx(1000.0)
    p.observe_step(200, 0.1)
    assert p.prefill_rate == pytest.approx(0.8 * 1000 + 0.2 * 2000)
    p.add("interactive", 3, 30)
    p.reset()
    assert (p.waiting_seqs, p.waiting_tokens, p.prefill_rate) == (0, 0, pytest.approx(1200.0))
