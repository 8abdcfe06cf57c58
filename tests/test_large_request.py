"""One request of 256 long prompts beside other clients (issue #44 item 2), in simulated time:
it ranks by its whole work, it cannot hold every seat against a short request, and no step grows
past the interactive budget while it runs (steps last what the cost model predicts)."""

from expresslane.config import SchedulerConfig
from expresslane.cost_model.base import StepShape
from expresslane.cost_model.piecewise import PiecewiseStepCostModel
from expresslane.scheduler.kv_cache import KVCacheManager
from expresslane.scheduler.scheduler import Scheduler

from test_slo_steps import H200, TPOT, TTFT, Sim, land, request, scheduler, shape_of

MIN_CHUNK = SchedulerConfig().min_prefill_chunk
LONE_STEP_SHARE = SchedulerConfig().lone_step_share

PROMPTS, LEN = 256, 2047


def sibling(i: int, t: float = 0.0, prompts: int = PROMPTS):
    """One of the prompts of a single request that carries `prompts` prompts of LEN tokens."""
    req = request(f"big{i}", LEN, 1, t)
    req.request_prompt_tokens = prompts * LEN
    return req


def test_a_request_ranks_by_the_work_of_all_its_prompts():
    sched = scheduler([0.0])
    deadline = sched.policy.deadline
    alone = request("alone", LEN, 1, 0.0)
    short = request("short", 64, 16, 5.0)
    assert deadline(alone) < deadline(short) < deadline(sibling(0))
    assert deadline(sibling(1)) - deadline(alone) > PROMPTS / 2 * (deadline(alone) - TTFT)


def test_a_short_request_takes_a_seat_from_a_prompt_still_in_prefill_not_from_a_decode():
    now = [0.0]
    sched = scheduler(now, max_num_seqs=9)
    sched.add_request(request("stream", 16, 64, 0.0))
    land(sched, sched.schedule())  # decoding from here on
    for i in range(8):
        sched.add_request(sibling(i, prompts=8))
    while len(sched.running) < 9:
        land(sched, sched.schedule())
    now[0] = 1.0
    sched.add_request(request("short", 64, 16, 1.0))
    plan = sched.schedule()
    assert "short" in {s.request_id for s in plan.seqs} and "stream" in sched.running
    assert len(sched.running) == 9 and sched.num_waiting == 1  # one of the eight went back to wait
    waiting = sched._peek_waiting()
    assert waiting.request_id.startswith("big") and waiting.num_computed_tokens == 0
    assert all(waiting.ttft_deadline >= r.ttft_deadline for r in sched.running.values() if r.request_id != "stream")


def test_steps_beside_one_huge_request_stay_within_the_interactive_budget_and_shorts_start_at_once():
    """A stream of short requests (one every 0.3 s) while one request's 256 prompts prefill: every
    step stays within the tpot target or an eighth of the TTFT target (what a request arriving
    meanwhile waits), and each short request starts in the first step planned after it arrives."""
    now = [0.0]
    arrivals = [sibling(i, 0.01) for i in range(PROMPTS)]
    arrivals += [request(f"s{k}", 64, 16, 0.3 * k) for k in range(40)]
    sim = Sim(scheduler(now, max_num_seqs=PROMPTS), now, arrivals)
    bound = max(TPOT, TTFT / LONE_STEP_SHARE)
    checked = 0
    for plan, _ in sim.run(max_steps=4000):
        if plan is None:
            continue
        shape = shape_of(plan)
        prefill = shape.num_tokens - sum(1 for s in plan.seqs if len(s.token_ids) == 1)
        assert H200.predict(shape) <= bound + 1e-12 or prefill <= MIN_CHUNK, (H200.predict(shape), shape)
        checked += 1
    shorts = [f"s{k}" for k in range(40)]
    assert all(sim.first_scheduled_step[s] == sim.added_before_step[s] for s in shorts)
    assert not sim.sched.has_unfinished() and not sim.todo  # the big request completed too
    assert checked > 500 and H200.predict(StepShape(0).plus_chunk(0, LEN)) > bound  # one prompt alone is over it


# A small model on one CPU core: a decode's step 4 ms, each prompt token 0.6 ms more, so even
# MIN_CHUNK prompt tokens beside a decode are over the lane's slack
SLOW = PiecewiseStepCostModel([1, 16, 64, 2048], [4e-3, 13e-3, 41.8e-3, 1.232])


def test_where_no_prefill_fits_beside_a_decode_a_step_carries_one_min_chunk_in_all():
    """The floor is the step's, not each prompt's: a starting prompt's first chunk and the running
    prompts' chunks share one MIN_CHUNK, so a decoding stream's steps stay one decode plus MIN_CHUNK
    prompt tokens beside one request's 256 prompts; each short request still starts in the first
    step after it arrives, and the running prompts go on (one finishes its prefill)."""
    now = [0.0]
    cfg = SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=PROMPTS + 8, scheduling_policy="deadline",
                          lane_slo=f"interactive:ttft={TTFT * 1e3:g}ms,tpot={TPOT * 1e3:g}ms")
    sched = Scheduler(cfg, KVCacheManager(40_000, 16), clock=lambda: now[0], cost_model=SLOW)
    sched.add_request(request("stream", 16, 100_000, 0.0))
    land(sched, sched.schedule())
    arrivals = [sibling(i, 0.01) for i in range(PROMPTS)] + [request(f"s{k}", 64, 16, 0.3 * k) for k in range(1, 6)]
    sim = Sim(sched, now, arrivals)
    beside = 0
    for plan, _ in sim.run(max_steps=1500):
        if plan is None or "stream" not in {s.request_id for s in plan.seqs}:
            continue
        prefill = sum(len(s.token_ids) for s in plan.seqs if len(s.token_ids) > 1)
        assert prefill <= MIN_CHUNK, {s.request_id: len(s.token_ids) for s in plan.seqs}
        beside += prefill > 0
    assert beside > 1000
    assert all(sim.first_scheduled_step[f"s{k}"] == sim.added_before_step[f"s{k}"] for k in range(1, 6))
    assert any(sim.first_token.get(f"big{i}") for i in range(PROMPTS))  # a sibling's prefill completed


def test_a_waiting_prompt_without_a_seat_does_not_take_the_running_prompts_chunk():
    """Every seat held (the stream and 8 of a request's 16 prompts) and no victim for the next of
    them: the step is sized for the running requests, so the running prompts still get their
    MIN_CHUNK beside the stream's decode in every step, and one completes its prefill."""
    now = [0.0]
    cfg = SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=9, scheduling_policy="deadline",
                          lane_slo=f"interactive:ttft={TTFT * 1e3:g}ms,tpot={TPOT * 1e3:g}ms")
    sched = Scheduler(cfg, KVCacheManager(40_000, 16), clock=lambda: now[0], cost_model=SLOW)
    sched.add_request(request("stream", 16, 100_000, 0.0))
    land(sched, sched.schedule())
    for i in range(16):
        sched.add_request(sibling(i, prompts=16))
    steps = 0
    while sched.num_waiting == 8 or len(sched.running) < 9:  # until a prompt finishes and frees its seat
        plan = sched.schedule()
        if len(sched.running) == 9:
            assert sched.policy.victim(sched._peek_waiting(), sched.running.values()) is None
            prefill = sum(len(s.token_ids) for s in plan.seqs if s.request_id != "stream")
            assert prefill == MIN_CHUNK and "stream" in {s.request_id for s in plan.seqs}, \
                {s.request_id: len(s.token_ids) for s in plan.seqs}
            steps += 1
        land(sched, plan)
        now[0] += SLOW.predict(shape_of(plan))
    assert sched.num_waiting == 7 and steps > LEN // MIN_CHUNK - 16
