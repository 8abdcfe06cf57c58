"""Scheduler and KV-cache invariants in plain Python (no torch, no model)."""

import random
import subprocess
import sys

import pytest

from expresslane.config import SchedulerConfig
from expresslane.scheduler.batching import make_scheduler
from expresslane.contract import EngineCoreRequest, StepPlan
from expresslane.scheduler.kv_cache import KVCacheManager, hash_block, max_blocks_per_request
from expresslane.scheduler.request import Request
from expresslane.scheduler.scheduler import Scheduler
from expresslane.sampling_params import SamplingParams

EOS = 0


def make_request(rid, prompt, max_tokens, priority=0, t=0.0, max_model_len=4096, lane="interactive"):
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return Request.from_core_request(EngineCoreRequest(rid, prompt, sp, (EOS,), t, priority, lane), max_model_len)


def check_invariants(sched: Scheduler, kv: KVCacheManager) -> None:
    holders: dict[int, int] = {}
    for rid in list(sched.requests):
        for b in kv.held_block_ids(rid):
            holders[b] = holders.get(b, 0) + 1
    for block in kv.pool.blocks:
        assert block.ref_cnt == holders.get(block.block_id, 0), f"block {block.block_id} refcount off"
        in_free = block.block_id in kv.pool._free
        assert in_free == (block.ref_cnt == 0), f"block {block.block_id}: free={in_free} ref={block.ref_cnt}"
    for rid, req in sched.running.items():
        assert len(kv.block_ids(rid)) * kv.block_size >= req.num_computed_tokens
    for rid in sched.requests:
        if rid not in sched.running:
            assert not kv.block_ids(rid), "a waiting request holds blocks"


def check_block_contents(sched: Scheduler, kv: KVCacheManager) -> None:
    """Every block a running request holds at table index i of a KV group is either unpublished or
    published for exactly the tokens of its block i in that group: a prefix hit never reads a block
    for other positions."""
    for rid, req in sched.running.items():
        parent = None
        hashes = []
        for i in range(req.num_tokens // kv.block_size):
            parent = hash_block(parent, req.all_token_ids[i * kv.block_size:(i + 1) * kv.block_size])
            hashes.append(parent)
        for g, blocks in enumerate(kv._req_blocks[rid]):
            for i, block in enumerate(blocks):
                if block is not None and block.block_hash is not None:
                    assert block.block_hash == kv._group_key(hashes[i], g), \
                        f"block {block.block_id} published for other tokens"


def group_table(kv: KVCacheManager, rid: str, group: int) -> list[int]:
    table = kv.block_ids(rid)
    n = len(table) // kv.num_groups
    return table[group * n:(group + 1) * n]


def drive(seed, num_blocks, budget, max_seqs, policy, caching, steps=4000, pipelined=False, windows=(None,)):
    """Random arrivals, aborts and tokens. `pipelined`: step N+1 is planned before step N's
    tokens are applied, as the engine does to overlap host and GPU work. `windows`: the KV
    groups' sliding windows (the KV manager frees blocks out of them)."""
    rng = random.Random(seed)
    kv = KVCacheManager(num_blocks, 4, enable_prefix_caching=caching, windows=windows)
    now = [0.0]  # one step = 10 ms: deadline's long prompts step aside for a while, then not
    sched = Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                                      scheduling_policy=policy), kv, clock=lambda: now[0])
    shared = [rng.randrange(1, 50) for _ in range(12)]
    submitted, finished, aborted = set(), set(), set()
    next_id = 0
    prev_plan, prev_sampled = StepPlan(-1, [], 0), {}
    tables: dict[str, list[list[int]]] = {}  # the runner's view: block tables rebuilt from the plans alone
    for step in range(steps):
        now[0] = step / 100
        if next_id < 60 and rng.random() < 0.4:
            n = rng.randint(1, 30)
            prefix = shared[:rng.randint(0, 12)] if rng.random() < 0.5 else []
            prompt = prefix + [rng.randrange(1, 50) for _ in range(n)]
            sched.add_request(make_request(str(next_id), prompt, rng.randint(1, 20), rng.randint(0, 3), now[0],
                                           lane=rng.choice(("interactive", "batch"))))
            submitted.add(str(next_id))
            next_id += 1
        if sched.requests and rng.random() < 0.03:
            victim = rng.choice(sorted(sched.requests))
            for out in sched.abort([victim]):
                assert out.finish_reason == "abort"
                aborted.add(victim)
        plan = sched.schedule()
        assert plan.num_batched_tokens <= budget
        assert sum(len(s.token_ids) for s in plan.seqs) == plan.num_batched_tokens
        assert len(sched.running) <= max_seqs
        assert len({s.request_id for s in plan.seqs}) == len(plan.seqs)
        if plan.seqs:
            for rid in plan.finished_request_ids + plan.preempted_request_ids:
                tables.pop(rid, None)
            for new in plan.new_requests:
                assert new.request_id not in tables
                tables[new.request_id] = [[] for _ in windows]
        for s in plan.seqs:
            new = len(s.new_block_ids) // len(windows)
            for g, table in enumerate(tables[s.request_id]):
                table += s.new_block_ids[g * new:(g + 1) * new]
                first = kv.first_needed_block(s.start_pos, g)  # (0 without a window) the blocks this step reads
                assert table[first:] == group_table(kv, s.request_id, g)[first:]
                assert len(table) * kv.block_size >= s.start_pos + len(s.token_ids)
                if windows[g] is not None:  # the blocks before `first` freed, those after held
                    assert kv.num_held_blocks(s.request_id, g) == len(table) - first
            assert kv.num_held_blocks(s.request_id) <= max_blocks_per_request(4096, 4, windows, budget)
        for s in plan.seqs:
            assert s.from_previous == (pipelined and s.request_id in prev_sampled), "input token source"
        sampled = {s.request_id: rng.choice([EOS] + list(range(1, 50)) * 8) for s in plan.seqs if s.sample}
        if pipelined:
            (plan, sampled), (prev_plan, prev_sampled) = (prev_plan, prev_sampled), (plan, sampled)
        for out in sched.update(plan, sampled):
            if out.finish_reason:
                finished.add(out.request_id)
        check_invariants(sched, kv)
        check_block_contents(sched, kv)
        if next_id >= 60 and not sched.has_unfinished() and not prev_plan.seqs:
            break
    assert not sched.has_unfinished(), "every request must finish"
    assert finished | aborted == submitted and not finished & aborted
    assert kv.pool.num_free == num_blocks and kv.num_held_blocks() == 0
    return sched


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("policy", ["fcfs", "priority", "deadline"])
@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("pipelined", [False, True])
def test_random_workload_invariants(seed, policy, caching, pipelined):
    sched = drive(seed, num_blocks=16, budget=rng_budget(seed), max_seqs=6, policy=policy, caching=caching,
                  pipelined=pipelined)
    assert sched.num_preemptions > 0  # 16 blocks of 4 tokens is tight on purpose


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("pipelined", [False, True])
def test_random_workload_invariants_with_a_sliding_window(seed, pipelined):
    """A window of 6 tokens (blocks of 4) on every layer: blocks freed as requests move on,
    windowed prefix hits, preemptions; refcounts, tables and bounds hold at every step."""
    sched = drive(seed, num_blocks=16, budget=rng_budget(seed), max_seqs=6, policy="fcfs", caching=True,
                  pipelined=pipelined, windows=(6,))
    assert sched.num_preemptions > 0 and sched.kv.window_freed_blocks > 0 and sched.kv.window_saved_blocks == 0
    assert sched.kv.prefix_cache_hits > 0


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("pipelined", [False, True])
def test_random_workload_invariants_with_kv_groups(seed, pipelined):
    """Layers in three KV groups (windows of 6 and 9 tokens, and one reading every key) from one
    pool: the windowed groups free blocks as requests move on, prefix hits need the whole prefix in
    the global group and the window's blocks in the others; refcounts, tables and bounds hold."""
    sched = drive(seed, num_blocks=40, budget=rng_budget(seed), max_seqs=6, policy="fcfs", caching=True,
                  pipelined=pipelined, windows=(6, None, 9))
    assert sched.num_preemptions > 0 and sched.kv.window_freed_blocks > 0 and sched.kv.window_saved_blocks == 0
    assert sched.kv.prefix_cache_hits > 0


def rng_budget(seed):
    return (8, 16, 33, 64, 24, 128)[seed]


def test_prefill_and_decode_share_a_step():
    kv = KVCacheManager(100, 4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=10, scheduling_policy="fcfs"), kv)
    sched.add_request(make_request("a", list(range(1, 4)), 5))
    plan = sched.schedule()
    sched.update(plan, {s.request_id: 7 for s in plan.seqs if s.sample})
    sched.add_request(make_request("long", list(range(1, 40)), 5, t=1.0))
    plan = sched.schedule()
    by_id = {s.request_id: len(s.token_ids) for s in plan.seqs}
    assert by_id == {"a": 1, "long": 9}  # the decode first, the prompt chunked to the rest of the budget


def test_priority_policy_orders_waiting_requests():
    kv = KVCacheManager(100, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=1, scheduling_policy="priority"), kv)
    sched.add_request(make_request("late-urgent", [1, 2], 1, priority=-1, t=2.0))
    sched.add_request(make_request("early", [1, 2], 1, priority=0, t=1.0))
    assert [s.request_id for s in sched.schedule().seqs] == ["late-urgent"]


def test_preemption_picks_lowest_priority_latest_arrival():
    kv = KVCacheManager(6, 4, enable_prefix_caching=False)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=100, scheduling_policy="priority"), kv)
    for rid, prio, t in (("a", 0, 0.0), ("b", 1, 1.0), ("c", 1, 2.0)):
        sched.add_request(make_request(rid, list(range(1, 8)), 20, prio, t))  # 2 blocks each: all 6 used
    for _ in range(3):  # prefill, a decode into the 2nd block, then each needs a 3rd block
        plan = sched.schedule()
        sched.update(plan, {s.request_id: 5 for s in plan.seqs})
    assert "c" not in sched.running and "a" in sched.running
    assert sched.requests["c"].num_computed_tokens == 0 and sched.num_preemptions >= 1


def test_prefix_cache_reuses_blocks_and_never_covers_last_token():
    kv = KVCacheManager(20, 4)
    sched = Scheduler(SchedulerConfig(), kv)
    prompt = list(range(1, 13))  # exactly 3 blocks
    sched.add_request(make_request("a", prompt, 1))
    plan = sched.schedule()
    sched.update(plan, {s.request_id: 99 for s in plan.seqs})
    sched.add_request(make_request("b", prompt, 1, t=1.0))
    [seq] = sched.schedule().seqs
    assert seq.start_pos == 8 and seq.token_ids == prompt[8:]  # 2 of 3 blocks hit: the last token is recomputed
    assert kv.prefix_cache_hits == 8


def test_lru_evicts_oldest_free_block_lazily():
    kv = KVCacheManager(4, 2)
    a = make_request("a", [1, 2, 3, 4, 5], 1)
    kv.allocate_slots(a, 5)
    a.num_computed_tokens = 5
    kv.free(a)  # blocks return to the free list, still cached
    assert kv.pool.num_free == 4 and kv.find_cached_prefix(make_request("x", [1, 2, 3, 4, 9], 1))
    b = make_request("b", [7, 8, 9], 1)
    kv.allocate_slots(b, 3)  # takes 2 blocks: the untouched one, then a's tail block ([5])
    hits = kv.find_cached_prefix(make_request("y", [1, 2, 3, 4, 9], 1))
    assert len(hits) == 2, "a's first full blocks must survive: evicted last"


def test_double_free_is_detected():
    kv = KVCacheManager(4, 2)
    blocks = kv.pool.allocate(1)
    kv.pool.release(blocks)
    with pytest.raises(RuntimeError, match="freed twice"):
        kv.pool.release(blocks)


def test_scheduler_kv_cache_and_step_contract_import_no_torch():
    """What the scheduler and the API process import of the engine stays torch-free."""
    modules = ", ".join(f"expresslane.{m}" for m in ("scheduler.batching", "scheduler.kv_cache", "contract", "config"))
    code = f"import sys, {modules}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr[-2000:] or out.stdout


def run_fixed_batches(batching, clock=None):
    kv = KVCacheManager(200, 4)
    cfg = SchedulerConfig(batching=batching, max_batch_size=3, batch_timeout_ms=100, max_num_batched_tokens=8)
    sched = make_scheduler(cfg, kv, clock=clock) if clock else make_scheduler(cfg, kv)
    for i, n in enumerate((40, 2, 3, 4)):
        sched.add_request(make_request(str(i), list(range(1, n + 1)), 2 + i, t=0.0))
    return sched, kv


def test_static_batches_prefill_whole_prompts_and_run_to_completion():
    sched, _ = run_fixed_batches("static")
    plan = sched.schedule()
    assert {s.request_id: len(s.token_ids) for s in plan.seqs} == {"0": 40, "1": 2, "2": 3}  # no budget, no chunks
    assert all(s.sample for s in plan.seqs)  # every first token comes after the whole batch's prefill
    sched.update(plan, {s.request_id: 5 for s in plan.seqs})
    seen_late = []
    while sched.has_unfinished():
        plan = sched.schedule()
        ids = {s.request_id for s in plan.seqs}
        if "3" in ids:
            seen_late.append(ids)
        sched.update(plan, {s.request_id: 5 for s in plan.seqs if s.sample})
        if "3" in ids:
            assert not ids & {"0", "1", "2"}, "request 3 must wait until the whole first batch is done"
    assert seen_late


def test_dynamic_batching_waits_for_a_full_batch_or_the_timeout():
    now = [0.0]
    sched, _ = run_fixed_batches("dynamic", clock=lambda: now[0])
    first = sched.schedule()
    assert len(first.seqs) == 3  # 4 waiting >= max_batch_size: go at once
    while sched.running:
        sched.update(first, {s.request_id: 5 for s in first.seqs if s.sample})
        first = sched.schedule()
    assert first.is_empty  # 1 waiting, arrived at t=0, now=0: wait for more
    now[0] = 0.2  # past the 100 ms timeout
    assert [s.request_id for s in sched.schedule().seqs] == ["3"]


def test_long_prefill_is_capped_while_short_requests_wait():
    kv = KVCacheManager(400, 4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, long_prefill_token_threshold=16,
                                      scheduling_policy="fcfs"), kv)
    sched.add_request(make_request("long", list(range(1, 500)), 4))
    plan = sched.schedule()
    assert [len(s.token_ids) for s in plan.seqs] == [64]  # alone: the whole budget (topped up)
    sched.update(plan, {})
    for i in range(3):
        sched.add_request(make_request(f"short{i}", [7 + 10 * i] * 5, 4, t=1.0 + i))
    plan = sched.schedule()
    sizes = {s.request_id: len(s.token_ids) for s in plan.seqs}
    assert sizes == {"long": 64 - 15, "short0": 5, "short1": 5, "short2": 5}  # shorts share the step
    assert sum(sizes.values()) == 64


def run_lanes(sched, arrivals, max_steps=400):
    """Drive a scheduler step by step (clock = step index); arrivals: step -> requests.
    Returns request id -> (arrival step, first scheduled step, finished step)."""
    seen: dict[str, list] = {}
    for step in range(max_steps):
        for req in arrivals.get(step, ()):
            sched.add_request(req)
            seen[req.request_id] = [step, None, None]
        plan = sched.schedule()
        for s in plan.seqs:
            if seen[s.request_id][1] is None:
                seen[s.request_id][1] = step
        for out in sched.update(plan, {s.request_id: 5 for s in plan.seqs if s.sample}):
            if out.finish_reason:
                seen[out.request_id][2] = step
        if step > max(arrivals) and not sched.has_unfinished():
            break
    return seen


def lanes_scheduler(num_blocks=2000, **cfg):
    kv = KVCacheManager(num_blocks, 4)
    now = [0.0]
    config = SchedulerConfig(scheduling_policy="deadline", **{"max_num_batched_tokens": 64, **cfg})
    return Scheduler(config, kv, clock=lambda: now[0]), kv


def test_deadline_lanes_schedule_each_short_request_within_a_step():
    sched, kv = lanes_scheduler(max_num_seqs=8)
    long = make_request("long", list(range(1, 3000)), 4, lane="batch")
    arrivals = {0: [long]}
    for i in range(40):  # a short interactive request every other step while the long one prefills
        step = 2 + 2 * i
        arrivals[step] = [make_request(f"s{i}", [100 + i] * 12, 3, t=float(step))]
    seen = run_lanes(sched, arrivals)
    delays = {rid: first - arrived for rid, (arrived, first, _) in seen.items() if rid != "long"}
    assert max(delays.values()) <= 1, delays
    assert all(done is not None for _, _, done in seen.values()), "every request finishes"
    assert seen["long"][2] is not None  # the long one is not starved
    assert kv.pool.num_free == kv.pool.num_blocks


def test_interactive_preempts_batch_when_seats_run_out_and_batch_resumes():
    sched, kv = lanes_scheduler(max_num_seqs=2)
    arrivals = {0: [make_request("b0", [1] * 20, 30, lane="batch", t=0.0),
                    make_request("b1", [2] * 20, 30, lane="batch", t=0.0)],
                5: [make_request("hi", [3] * 8, 3, t=5.0)]}
    seen = run_lanes(sched, arrivals)
    assert seen["hi"][1] == 5, "scheduled in its arrival step, taking a batch request's seat"
    assert sched.num_preemptions >= 1
    assert seen["b0"][2] is not None and seen["b1"][2] is not None  # both batch requests resume and finish


def test_lane_shares_keep_batch_work_moving_under_interactive_load():
    sched, _ = lanes_scheduler(max_num_seqs=64)
    arrivals = {0: [make_request("batch-long", list(range(1, 400)), 2, lane="batch", t=0.0)]}
    for step in range(0, 30):
        arrivals.setdefault(step, []).extend(
            make_request(f"i{step}-{j}", [200 + step] * 30 + [j], 2, t=float(step)) for j in range(4))
    seen = run_lanes(sched, arrivals)
    # 120 interactive prompt tokens arrive per step against a 64-token budget; the batch
    # lane still gets its 25% share: 399 tokens in ~25 steps, long before the flood ends
    assert seen["batch-long"][2] is not None and seen["batch-long"][2] < 40


def test_lane_slo_spec_errors():
    from expresslane.lanes import Lanes
    assert Lanes.parse("interactive:ttft=100ms")["interactive"].ttft == pytest.approx(0.1)
    for bad, msg in (("fast:ttft=1s", "unknown lane"), ("interactive:ttft=fast", "duration"),
                     ("batch:share=2", "share"), ("batch:speed=1", "unknown key")):
        with pytest.raises(ValueError, match=msg):
            Lanes.parse(bad)
        with pytest.raises(ValueError, match=msg):
            SchedulerConfig(lane_slo=bad)  # parsed once, when the config is built


def test_decodes_keep_their_place_while_a_long_prompt_is_chunked():
    kv = KVCacheManager(400, 4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=32, long_prefill_token_threshold=8,
                                      scheduling_policy="fcfs"), kv)
    sched.add_request(make_request("long", list(range(10, 400)), 2, t=0.0))  # first in line
    plan = sched.schedule()
    sched.update(plan, {})
    sched.add_request(make_request("dec", [1, 2, 3], 50, t=1.0))
    for step in range(10):  # nothing waits after the first step: only the two running requests
        plan = sched.schedule()
        sizes = {s.request_id: len(s.token_ids) for s in plan.seqs}
        assert sizes.get("dec") == (3 if step == 0 else 1), sizes  # in every step: its ITL holds
        assert sum(sizes.values()) == 32  # and the long prompt gets all the rest
        sched.update(plan, {s.request_id: 9 for s in plan.seqs if s.sample})


def test_deadline_caps_a_long_prompt_beside_others_without_top_up():
    sched, _ = lanes_scheduler(max_num_seqs=8, long_prefill_token_threshold=16)
    sched.add_request(make_request("dec", [1, 2, 3], 50, lane="batch"))
    sched.update(sched.schedule(), {"dec": 5})
    sched.add_request(make_request("long", list(range(10, 400)), 2))
    for _ in range(5):  # beside a decode the long prompt never takes more than the cap
        plan = sched.schedule()
        assert {s.request_id: len(s.token_ids) for s in plan.seqs} == {"dec": 1, "long": 16}
        sched.update(plan, {s.request_id: 5 for s in plan.seqs if s.sample})


def test_long_interactive_prefill_steps_aside_for_short_ones_until_its_deadline():
    now = [0.0]
    sched, _ = lanes_scheduler(max_num_seqs=8, long_prefill_token_threshold=16,
                               lane_slo="interactive:ttft=200ms")
    sched.clock = lambda: now[0]
    sched.add_request(make_request("long", list(range(10, 400)), 2))
    sched.update(sched.schedule(), {})
    now[0] = 0.05
    sched.add_request(make_request("short", [7] * 10, 2, t=0.05))
    plan = sched.schedule()  # the short prompt's step carries no long chunk
    assert {s.request_id: len(s.token_ids) for s in plan.seqs} == {"short": 10}
    sched.update(plan, {"short": 5})
    plan = sched.schedule()  # then the long one goes on, capped beside the short one's decode
    assert {s.request_id: len(s.token_ids) for s in plan.seqs} == {"short": 1, "long": 16}
    sched.update(plan, {"short": 5})
    now[0] = 0.25  # past the long prompt's own TTFT deadline: it no longer steps aside
    sched.add_request(make_request("late", [8] * 10, 2, t=0.25))
    plan = sched.schedule()
    assert {s.request_id for s in plan.seqs} == {"long", "late"}


def test_the_policy_sizes_each_step():
    """The per-step budget is the policy's decision (the seam for a step-cost model)."""
    from expresslane.scheduler.policy import SchedulingPolicy

    class FiveTokenSteps(SchedulingPolicy):
        def step_budget(self, head, running, waiting_by_lane, now=0.0, spec_tokens=0):
            budget = super().step_budget(head, running, waiting_by_lane, now, spec_tokens)
            budget.tokens = 5
            return budget

    kv = KVCacheManager(100, 4)
    sched = Scheduler(SchedulerConfig(), kv)
    sched.policy = FiveTokenSteps(sched.config)
    sched.add_request(make_request("a", list(range(1, 13)), 2))
    sizes = []
    while sched.has_unfinished():
        plan = sched.schedule()
        sizes.append(plan.num_batched_tokens)
        sched.update(plan, {s.request_id: 5 for s in plan.seqs if s.sample})
    assert sizes == [5, 5, 2, 1]
