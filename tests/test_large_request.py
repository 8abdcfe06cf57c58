"""One request of 256 long prompts beside other clients (issue #44 item 2), in simulated time:
it ranks by its whole work, it cannot hold every seat against a short request, and no step grows
past the interactive budget while it runs (steps last what the cost model predicts)."""

from expresslane.cost_model.base import StepShape
from expresslane.scheduler.policy import LONE_STEP_SHARE, MIN_CHUNK

from test_slo_steps import H200, TPOT, TTFT, Sim, land, request, scheduler, shape_of

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
