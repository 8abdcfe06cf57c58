"""Multi-LoRA serving (issue #41): adapters made by peft itself on a tiny random model; greedy
tokens with an adapter equal transformers' with the same adapter merged (float32), alone or in
a batch mixing the base model and three adapters of different ranks, through chunked prefill,
prefix hits (never across adapters), preemption, slot and host-tier evictions, unloads, and
loads in flight (a held copy, a blocked disk read) while other requests run."""

from __future__ import annotations

import gc
import importlib.util
import itertools
import json
import random
import threading
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
from models import hf_greedy, make_lora_adapter as make_adapter

from expresslane import LLM, LoRARequest, SamplingParams
from expresslane.config import EngineConfig, SchedulerConfig
from expresslane.contract import EngineCoreRequest
from expresslane.models.lora_adapter import AdapterError, read_adapter
from expresslane.runner.lora_copies import QUEUED, SlotCopies, SlotReads
from expresslane.runner.lora_host import AdapterReader
from expresslane.scheduler.kv_cache import KVCacheManager
from expresslane.scheduler.request import Request
from expresslane.scheduler.scheduler import Scheduler

peft = pytest.importorskip("peft")

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> (rank, targets, rslora): three ranks, different projections
ADAPTERS = {"all8": (8, ALL, False), "qv16": (16, ["q_proj", "v_proj"], True),
            "mlp4": (4, ["o_proj", "up_proj", "down_proj"], False)}


def merged_model(model_dir, adapter_dir, out):
    """transformers' model with the adapter merged by peft (the reference), saved as a directory."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft.PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload().save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def adapters(llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {name: LoRARequest(name, i, str(make_adapter(llama_dir, root / name, rank, targets, rslora, seed=i)))
            for i, (name, (rank, targets, rslora)) in enumerate(ADAPTERS.items(), 1)}


@pytest.fixture(scope="module")
def merged(llama_dir, adapters, tmp_path_factory):
    root = tmp_path_factory.mktemp("merged")
    return {name: merged_model(llama_dir, lora.lora_path, root / name) for name, lora in adapters.items()}


def make_prompts(n=8, seed=7):
    rng = random.Random(seed)
    shared = [rng.randrange(500) for _ in range(40)]
    prompts = [[rng.randrange(500) for _ in range(k)] for k in (1, 5, 17, 33, 70)]
    prompts += [shared + [rng.randrange(500) for _ in range(k)] for k in (3, 20)]
    return (prompts + [list(shared) + [1, 2, 3]])[:n]


PROMPTS = make_prompts()


@pytest.fixture(scope="module")
def references(llama_dir, merged):
    out = {None: [hf_greedy(llama_dir, p, MAX_TOKENS) for p in PROMPTS]}
    out.update({name: [hf_greedy(d, p, MAX_TOKENS) for p in PROMPTS] for name, d in merged.items()})
    return out


def test_each_adapter_matches_transformers_merged(llama_dir, adapters, references):
    llm = LLM(str(llama_dir), enable_lora=True, max_loras=1, max_lora_rank=16, scheduling_policy="fcfs")
    for name, lora in adapters.items():
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False, lora_request=lora)
        got = [o.outputs[0].token_ids for o in outs]
        assert got == references[name], name
        assert got != references[None], f"{name} changes nothing: the test cannot tell"
    base = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in base] == references[None]


# (engine kwargs, whether preemptions must happen)
MIXED = {
    "chunked": dict(max_num_batched_tokens=16, enable_prefix_caching=False),
    "prefix-hits": dict(max_num_batched_tokens=4096, scheduling_policy="fcfs"),
    "preempt": dict(max_num_batched_tokens=64, max_model_len=128, num_kv_blocks=10, scheduling_policy="fcfs"),
}


@pytest.mark.parametrize("case", list(MIXED))
def test_mixed_batch_equals_each_alone(llama_dir, adapters, references, case):
    """Base and three adapters in one batch; two slots and two host copies for three adapters, so
    slots are reused and adapters re-read from their directory."""
    llm = LLM(str(llama_dir), enable_lora=True, max_loras=2, max_lora_rank=16, **MIXED[case])
    runner = llm.engine.runner
    seen: list[int] = []
    prepare = runner.lora.prepare

    def counting(token_lora_ids):
        seen.append(len(set(token_lora_ids.tolist()) - {0}))
        prepare(token_lora_ids)

    runner.lora.prepare = counting
    stage = runner.stage_loras

    def keeping(wanted, keep):
        staging = stage(wanted, keep)
        assert keep <= staging.ready, "a running request's adapter lost its slot"
        return staging

    runner.stage_loras = keeping
    names = [None, *adapters]
    jobs = [(names[(i + j) % 4], p) for i, p in enumerate(PROMPTS) for j in range(4)]
    outs = llm.generate([{"prompt_token_ids": p} for _, p in jobs], GREEDY, use_tqdm=False,
                        lora_request=[adapters.get(n) if n else None for n, _ in jobs])
    for (name, prompt), out in zip(jobs, outs):
        assert out.outputs[0].token_ids == references[name][PROMPTS.index(prompt)], (name, prompt[:4])
    assert max(seen) == 2, "steps should mix adapters, never more than the slots"
    assert runner.lora.num_loads > 2, "three adapters in two slots: some must be loaded again"
    core = llm.engine.core
    if case == "preempt":
        assert core.scheduler.num_preemptions > 0
    if case == "prefix-hits":  # the shared prefix hits within an adapter, never across: see the hashes below
        assert any(o.num_cached_tokens for o in outs)
    assert core.kv.num_held_blocks() == 0


def test_triton_kernels_and_graph_buffers_match_transformers(llama_dir, adapters, references, monkeypatch):
    """The GPU path through Triton's interpreter: segmented shrink/expand, fed from the CUDA
    graphs' static buffers (built without capturing), mixing the base model and two adapters."""
    pytest.importorskip("triton")
    llm = LLM(str(llama_dir), attention_backend="triton", enable_lora=True, max_loras=2, max_lora_rank=16,
              max_num_batched_tokens=64, max_model_len=128, num_kv_blocks=32)
    llm.engine.runner.build_graphs(128, capture=False)
    from expresslane.layers.lora import LoRAStep

    loaded, fields = [], LoRAStep.fields  # the graphs' loads of each step's slots
    monkeypatch.setattr(LoRAStep, "fields", lambda static, step, padded: loaded.append(step is not None) or fields(
        static, step, padded))
    jobs = [(name, i) for i in (0, 2, 3) for name in (None, "all8", "qv16")]
    outs = llm.generate([{"prompt_token_ids": PROMPTS[i]} for _, i in jobs], GREEDY, use_tqdm=False,
                        lora_request=[adapters.get(n) if n else None for n, _ in jobs])
    mismatched = [job for job, o in zip(jobs, outs) if o.outputs[0].token_ids != references[job[0]][job[1]]]
    assert not mismatched
    assert any(loaded), "the steps ran through the graphs' buffers"
    from expresslane.layers import lora_kernels

    inline, gemv = [], lora_kernels.lora_gemv  # a lone request's decode steps: the one-token kernel
    monkeypatch.setattr(lora_kernels, "lora_gemv", lambda *a, **k: inline.append(1) or gemv(*a, **k))
    for name in ("all8", None):
        [o] = llm.generate([{"prompt_token_ids": PROMPTS[2]}], GREEDY, use_tqdm=False, lora_request=adapters.get(name))
        assert o.outputs[0].token_ids == references[name][2]
    from expresslane.layers.lora import LoRALinear

    wrapped = [m for m in llm.engine.runner.model.modules() if isinstance(m, LoRALinear)]
    assert wrapped and all(m.inline for m in wrapped)
    # every projection of each decode step (at least MAX_TOKENS - 1 a run), both runs
    assert len(inline) % len(wrapped) == 0 and len(inline) >= 2 * (MAX_TOKENS - 1) * len(wrapped)


def test_tensor_parallel_matches_transformers(llama_dir, adapters, references):
    """TP=2 over gloo: column-parallel projections keep their rows of B, row-parallel ones their
    columns of A, the delta summed with the partial products."""
    llm = LLM(str(llama_dir), tensor_parallel_size=2, enable_lora=True, max_loras=2, max_lora_rank=16,
              max_num_batched_tokens=64, scheduling_policy="fcfs")
    try:
        jobs = [(name, i) for i in (1, 3, 6) for name in (None, *adapters)]
        outs = llm.generate([{"prompt_token_ids": PROMPTS[i]} for _, i in jobs], GREEDY, use_tqdm=False,
                            lora_request=[adapters.get(n) if n else None for n, _ in jobs])
        with pytest.raises(AdapterError, match="no such directory"):  # refused on rank 0, before the workers
            llm.engine.add_lora(LoRARequest("bad", 7, "/nonexistent/adapter"))
        assert llm.engine.remove_lora(adapters["mlp4"].lora_int_id)
        again = llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False, lora_request=adapters["qv16"])
    finally:
        llm.engine.runner.shutdown()
    mismatched = [job for job, o in zip(jobs, outs) if o.outputs[0].token_ids != references[job[0]][job[1]]]
    assert not mismatched
    assert again[0].outputs[0].token_ids == references["qv16"][0]


def test_prefix_cache_keys_include_the_adapter():
    kv = KVCacheManager(64, 4)
    sp = SamplingParams(temperature=0.0, max_tokens=2)

    def request(rid, lora_id):
        lora = LoRARequest(f"a{lora_id}", lora_id, "/x") if lora_id else None
        req = Request.from_core_request(EngineCoreRequest(rid, list(range(1, 14)), sp, (0,), 0.0,
                                                          lora_request=lora), 64)
        req.cache_salt = f"lora:{lora_id}".encode() if lora_id else None
        return req

    first = request("a", 1)
    assert kv.allocate_slots(first, first.num_tokens, kv.find_cached_prefix(first))
    assert len(kv.find_cached_prefix(request("b", 1))) == 3  # the same adapter: hits
    assert kv.find_cached_prefix(request("c", 2)) == []  # another adapter: none
    assert kv.find_cached_prefix(request("d", 0)) == []  # the base model: none


def lora_scheduler(max_loras: int, requests) -> Scheduler:
    """An fcfs scheduler holding `requests` ((id, adapter id; 0: none), three-token prompts) in order."""
    kv = KVCacheManager(256, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256, scheduling_policy="fcfs"), kv,
                      max_loras=max_loras)
    sp = SamplingParams(temperature=0.0, max_tokens=3)
    for rid, lora_id in requests:
        lora = LoRARequest(f"l{lora_id}", lora_id, "/x") if lora_id else None
        sched.add_request(Request.from_core_request(EngineCoreRequest(rid, [1, 2, 3], sp, (0,), 0.0,
                                                                      lora_request=lora), 64))
    return sched


def test_a_request_waiting_for_a_slot_blocks_no_one():
    """One slot, two adapters: a step never holds both; base-model requests behind the second
    adapter's are admitted at once."""
    sched = lora_scheduler(1, (("a1", 1), ("b1", 2), ("base", 0), ("a2", 1)))
    plan = sched.schedule()
    assert {s.request_id for s in plan.seqs} == {"a1", "base", "a2"}
    assert sched.num_waiting == 1
    for step in range(20):
        loras = {sched.requests[s.request_id].lora_id for s in plan.seqs if s.request_id in sched.requests}
        assert len(loras - {0}) <= 1
        sched.update(plan, {s.request_id: 5 for s in plan.seqs if s.sample})
        plan = sched.schedule()
        if not sched.has_unfinished():
            break
    assert not sched.has_unfinished(), "the second adapter's request ran once the first's finished"


@pytest.mark.parametrize("seed", range(3))
def test_random_workloads_never_plan_more_adapters_than_slots(seed):
    """Random arrivals over four adapters and the base model, two slots, a small KV cache
    (preemptions): every plan holds at most two adapters, and every request finishes."""
    rng = random.Random(seed)
    kv = KVCacheManager(20, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32, scheduling_policy="fcfs"), kv,
                      max_loras=2)
    added = 0
    for step in range(3000):
        if added < 60 and rng.random() < 0.3:
            lora_id = rng.randrange(5)
            lora = LoRARequest(f"l{lora_id}", lora_id, "/x") if lora_id else None
            sp = SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 12))
            prompt = [rng.randrange(1, 50) for _ in range(rng.randint(1, 40))]
            sched.add_request(Request.from_core_request(EngineCoreRequest(str(added), prompt, sp, (0,), 0.0,
                                                                          lora_request=lora), 128))
            added += 1
        plan = sched.schedule()
        loras = {sched.requests[s.request_id].lora_id for s in plan.seqs} - {0}
        assert len(loras) <= 2, (step, loras)
        sched.update(plan, {s.request_id: rng.randrange(1, 50) for s in plan.seqs if s.sample})
        if added == 60 and not sched.has_unfinished():
            break
    assert not sched.has_unfinished() and kv.num_held_blocks() == 0
    assert sched.num_preemptions > 0


def test_unload_waits_for_its_requests_and_leaks_no_slot(llama_dir, adapters, references):
    llm = LLM(str(llama_dir), enable_lora=True, max_loras=2, max_lora_rank=16, max_cpu_loras=3)
    engine, slots = llm.engine, llm.engine.runner.lora
    a, b = adapters["all8"], adapters["qv16"]
    for i, (lora, prompt) in enumerate([(a, PROMPTS[3]), (b, PROMPTS[4]), (a, PROMPTS[2]), (None, PROMPTS[1])]):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, GREEDY, lora_request=lora)
    engine.step()
    engine.step()
    host_a = weakref.ref(slots.host[a.lora_int_id])
    assert engine.remove_lora(a.lora_int_id)
    assert engine.list_loras() == {b.lora_int_id}
    assert a.lora_int_id in slots.registered, "its requests still run: it stays"
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert done["0"] == references["all8"][3] and done["2"] == references["all8"][2]
    assert done["1"] == references["qv16"][4] and done["3"] == references[None][1]
    assert a.lora_int_id not in slots.registered and a.lora_int_id not in slots.slot_of
    assert a.lora_int_id not in slots.host
    assert len(slots._free_slots) + len(slots.slot_of) == 2, "every slot is free or held by a served adapter"
    gc.collect()
    assert host_a() is None, "no host (pinned on CUDA) buffer of the unloaded adapter is left"
    assert not engine.remove_lora(a.lora_int_id)
    # loaded again under a new id: served again, right
    again = LoRARequest("all8-again", 9, a.lora_path)
    out = llm.generate([{"prompt_token_ids": PROMPTS[5]}], GREEDY, use_tqdm=False, lora_request=again)
    assert out[0].outputs[0].token_ids == references["all8"][5]


def test_a_slot_load_waits_only_for_the_steps_that_read_the_slot():
    """A load into a slot waits for the mark after the slot's last reader: nothing for a slot
    never read, every queued step when its reader is the last step queued (no mark after it
    yet), and a mark is recorded only when some read is not yet covered by one."""
    reads = SlotReads()
    marks = itertools.count(100)
    recorded = []

    def mark():
        recorded.append(next(marks))
        return recorded[-1]

    reads.step([], mark)  # step 0: base model only
    assert reads.after(1) is None and recorded == []
    reads.step([1, 2], mark)  # step 1 reads slots 1 and 2
    assert reads.after(1) is QUEUED and reads.after(3) is None
    reads.step([2], mark)  # step 2: mark 100 after steps 0-1
    assert recorded == [100] and reads.after(1) == 100 and reads.after(2) is QUEUED
    reads.step([], mark)  # step 3: mark 101 after steps 0-2
    reads.step([], mark)  # step 4: every read covered, no mark
    assert recorded == [100, 101] and reads.after(2) == 101 and reads.after(1) == 100
    for _ in range(SlotReads.KEEP + 2):  # marks roll over; a later one still covers slot 1's reader
        reads.step([2], mark)
    assert reads.after(1) == recorded[-SlotReads.KEEP]
    assert reads.after(2) is QUEUED


class HeldCopies(SlotCopies):
    """Slot copies that run at once but report done only after `finish()`: a copy in flight."""

    def __init__(self):
        super().__init__(torch.device("cpu"))
        self.finished = False
        self.waited: list[int] = []
        self._events = itertools.count(1)

    def run(self, slot, copy):
        copy()
        return next(self._events)

    def done(self, event):
        return self.finished

    def wait(self, event):
        self.waited.append(event)

    def finish(self):
        self.finished = True


def run_until_done(engine, done):
    """Step `engine` until no request is left; `done`: request id -> tokens."""
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids


def test_a_request_whose_adapter_is_loading_holds_up_no_one(llama_dir, adapters, references):
    """While its adapter's slot copy is in flight the request is passed over and the base-model
    request decodes; once the copy is done it runs (its first step waits for the copy on the
    device), and both equal transformers."""
    llm = LLM(str(llama_dir), enable_lora=True, max_loras=1, max_lora_rank=16, scheduling_policy="fcfs")
    engine, slots = llm.engine, llm.engine.runner.lora
    slots.copies = copies = HeldCopies()
    lora = adapters["all8"]
    engine.add_request("lora", {"prompt_token_ids": PROMPTS[2]}, GREEDY, lora_request=lora)
    engine.add_request("base", {"prompt_token_ids": PROMPTS[1]}, GREEDY)
    seen = [out.request_id for _ in range(5) for out in engine.step()]
    assert seen.count("base") >= 3 and "lora" not in seen
    assert lora.lora_int_id in slots.slot_of, "its copy was started"
    assert engine.core.scheduler.requests["lora"].num_computed_tokens == 0
    assert lora.lora_int_id in engine.core.scheduler.lora_wanted
    copies.finish()
    done = {}
    run_until_done(engine, done)
    assert done == {"lora": references["all8"][2], "base": references[None][1]}
    assert copies.waited == [1], "the compute stream waits for the copy once, at its first use"


@pytest.mark.parametrize("cold_by", ["host-miss", "request"])
def test_a_disk_read_runs_off_the_step_loop(llama_dir, adapters, references, cold_by):
    """One adapter on the host; the other, evicted from it (host-miss) or named first by a request,
    is read on a background thread, blocked, while the steps go on for the base model and the
    adapter on the host; released, the read lands, the slot loads between steps, and every
    request equals transformers."""
    llm = LLM(str(llama_dir), enable_lora=True, max_loras=1, max_cpu_loras=1, max_lora_rank=16,
              scheduling_policy="fcfs")
    engine, slots = llm.engine, llm.engine.runner.lora
    cold, warm = adapters["all8"], adapters["qv16"]
    if cold_by == "host-miss":
        engine.add_lora(cold)
    engine.add_lora(warm)
    assert list(slots.host) == [warm.lora_int_id]
    gate, started, threads = threading.Event(), threading.Event(), []
    read = slots.reader.read

    def blocked(lora):
        threads.append(threading.current_thread())
        started.set()
        gate.wait(60)  # bounded: a read on the step loop must not hang the test
        return read(lora)

    slots.reader.close()
    slots.reader = AdapterReader(blocked, wait=False)
    engine.add_request("cold", {"prompt_token_ids": PROMPTS[3]}, GREEDY, lora_request=cold)
    engine.add_request("base", {"prompt_token_ids": PROMPTS[1]}, GREEDY)
    engine.add_request("warm", {"prompt_token_ids": PROMPTS[4]}, GREEDY, lora_request=warm)
    try:
        seen = [out.request_id for _ in range(2) for out in engine.step()]
        assert started.wait(60), "the read was submitted"
        seen += [out.request_id for _ in range(4) for out in engine.step()]
    finally:
        gate.set()
    assert threads and threads[0] is not threading.main_thread()
    assert seen.count("base") >= 4 and seen.count("warm") >= 4 and "cold" not in seen
    slots.reader.join()
    done = {}
    run_until_done(engine, done)
    assert done == {"cold": references["all8"][3], "base": references[None][1], "warm": references["qv16"][4]}
    loras = engine.core.loras
    assert loras.num_loads == 2 and not loras.reading, "two adapters read and checked; a host-tier miss is no load"
    slots.reader.close()


def test_an_adapter_read_that_fails_rejects_its_requests_only(llama_dir, adapters, references):
    """Read off the step loop, an adapter over max_lora_rank: its request is rejected with the
    reason, the adapter forgotten; the base-model request runs on."""
    llm = LLM(str(llama_dir), enable_lora=True, max_lora_rank=8, scheduling_policy="fcfs")
    core, slots = llm.engine.core, llm.engine.runner.lora
    slots.reader.wait = False
    bad = adapters["qv16"]
    core.add_request(EngineCoreRequest("bad", PROMPTS[2], GREEDY, (0,), 0.0, lora_request=bad))
    core.add_request(EngineCoreRequest("base", PROMPTS[1], GREEDY, (0,), 0.0))
    slots.reader.join()
    tokens = [t for out in core.step() for t in out.new_token_ids]
    assert core.take_rejected() == {"bad": f"LoRA adapter {bad.lora_path!r}: rank 16 is over max_lora_rank 8"}
    assert "bad" not in core.scheduler.requests and bad.lora_int_id not in core.loras.loaded
    assert bad.lora_int_id not in slots.registered
    while core.has_unfinished():
        tokens += [t for out in core.step() for t in out.new_token_ids]
    assert tokens == references[None][1]


def test_eviction_never_picks_a_slot_a_running_request_uses(llama_dir, adapters):
    llm = LLM(str(llama_dir), enable_lora=True, max_loras=2, max_cpu_loras=3, max_lora_rank=16)
    slots = llm.engine.runner.lora
    for lora in adapters.values():
        llm.engine.add_lora(lora)
    one, two, three = (lora.lora_int_id for lora in adapters.values())
    assert slots.stage([one, two], keep=set()).ready == {one, two}
    arena = slots.state.slots  # every projection's A and B are views of it: a slot loads in one copy
    storage = arena.untyped_storage().data_ptr()
    assert all(m.lora_a.untyped_storage().data_ptr() == storage for m in slots.modules.values())
    starts = [t.storage_offset() for m in slots.modules.values() for t in (m.lora_a, m.lora_b)]
    assert all(start % 64 == 0 for start in starts) and len(set(starts)) == len(starts)
    assert torch.equal(arena[slots.slot_of[one]], slots.host[one]) and not arena[0].any()
    assert slots.stage([three], keep={one}).ready == {one, three}, "two goes, though one is older"
    assert slots.stage([two], keep={one, three}).ready == {one, three}, "every slot is in use: two waits"
    assert two not in slots.slot_of and slots.num_loads == 3
    assert slots.stage([two, one], keep=set()).ready == {two, one}, "the wanted keep theirs: three goes"
    assert slots.num_loads == 4, "one stayed in its slot"


def test_a_request_whose_adapter_is_not_ready_is_passed_over():
    sched = lora_scheduler(2, (("cold", 2), ("warm", 1), ("base", 0), ("cold2", 2)))
    sched.lora_ready = {1}
    plan = sched.schedule()
    assert {s.request_id for s in plan.seqs} == {"warm", "base"}
    assert list(sched.lora_wanted) == [2]
    sched.update(plan, {s.request_id: 5 for s in plan.seqs})
    sched.lora_ready = {1, 2}
    plan = sched.schedule()
    assert {s.request_id for s in plan.seqs} == {"cold", "cold2", "warm", "base"}
    assert not sched.lora_wanted


def test_bad_adapters_are_refused_naming_the_file(llama_dir, adapters, tmp_path):
    good = adapters["all8"].lora_path
    with pytest.raises(AdapterError, match="no such directory"):
        read_adapter(tmp_path / "missing", 16)
    with pytest.raises(AdapterError, match="rank 16 is over max_lora_rank 8"):
        read_adapter(adapters["qv16"].lora_path, 8)
    bad = tmp_path / "bad"
    bad.mkdir()
    with pytest.raises(AdapterError, match="adapter_config.json is missing"):
        read_adapter(bad, 16)
    (bad / "adapter_config.json").write_text("{not json")
    with pytest.raises(AdapterError, match=r"bad/adapter_config.json.*cannot read it"):
        read_adapter(bad, 16)
    config = json.loads((Path(good) / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(AdapterError, match="use_dora is not served"):
        read_adapter(bad, 16)
    (bad / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(AdapterError, match="adapter_model.safetensors is missing"):
        read_adapter(bad, 16)
    (bad / "adapter_model.safetensors").write_bytes(b"garbage")
    with pytest.raises(AdapterError, match=r"bad/adapter_model.safetensors.*cannot read it"):
        read_adapter(bad, 16)
    llm = LLM(str(llama_dir), enable_lora=True, max_lora_rank=8)
    with pytest.raises(ValueError, match="over max_lora_rank 8"):
        llm.generate([{"prompt_token_ids": [1, 2]}], GREEDY, use_tqdm=False, lora_request=adapters["qv16"])
    assert not llm.engine.has_unfinished()


def test_an_adapter_of_an_unserved_module_is_refused(llama_dir, tmp_path):
    path = make_adapter(llama_dir, tmp_path / "embed", 4, ["embed_tokens", "q_proj"])
    with pytest.raises(AdapterError, match="embed_tokens.*not served"):
        read_adapter(path, 16)


def test_lora_flags_are_checked(llama_dir):
    with pytest.raises(ValueError, match="max_cpu_loras .1. must be at least max_loras .2."):
        EngineConfig.from_kwargs(enable_lora=True, max_loras=2, max_cpu_loras=1)
    with pytest.raises(ValueError, match="lora_modules needs enable_lora"):
        EngineConfig.from_kwargs(lora_modules=("a=/x",))
    with pytest.raises(ValueError, match="expected name=path"):
        EngineConfig.from_kwargs(enable_lora=True, lora_modules=("a",))
    with pytest.raises(ValueError, match="max_lora_rank must be a positive integer"):
        EngineConfig.from_kwargs(enable_lora=True, max_lora_rank=0)
    config = EngineConfig.from_kwargs(enable_lora=True, lora_modules=("a=/x", '{"name": "b", "path": "/y"}'))
    assert [(a.lora_name, a.lora_int_id, a.lora_path) for a in config.lora.startup_loras()] == [
        ("a", 1, "/x"), ("b", 2, "/y")]
    with pytest.raises(ValueError, match="given twice"):
        EngineConfig.from_kwargs(enable_lora=True, lora_modules=("a=/x", "a=/y"))
    with pytest.raises(ValueError, match="without enable_lora"):
        LLM(str(llama_dir), num_kv_blocks=64, max_model_len=256).generate(
            ["hi"], GREEDY, use_tqdm=False, lora_request=LoRARequest("x", 1, "/x"))


# (slices, the input dim): slices off the output tiles (a launch each) and on them (one launch); an
# input dim the shrink splits in parts, the last one short
LAYOUTS = {"per-slice": ([(0, 32), (32, 16), (48, 16)], 48), "one-launch": ([(0, 128), (128, 64), (192, 64)], 300)}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("num_tokens", [11, 40])
def test_triton_shrink_expand_match_torch(layout, num_tokens):
    pytest.importorskip("triton")
    from expresslane.layers.lora import LoRAStep, add_lora
    from expresslane.layers.lora_kernels import num_splits

    torch.manual_seed(0)
    slices, hidden = LAYOUTS[layout]
    slots, rank, out = 4, 16, slices[-1][0] + slices[-1][1]
    a = torch.randn(slots, len(slices) * rank, hidden)
    b = torch.randn(slots, out, rank)
    a[0], b[0] = 0, 0
    token_slots = np.random.default_rng(num_tokens).integers(0, slots, num_tokens)
    token_slots[::2] = 2  # slot 2's run spans tiles (at 40 tokens)
    step = LoRAStep.of(token_slots, slots, torch.device("cpu"))
    x = torch.randn(num_tokens, hidden)
    y = torch.randn(num_tokens, out)
    want = add_lora(y.clone(), x, a, b, slices, step, use_triton=False)
    got = add_lora(y.clone(), x, a, b, slices, step, use_triton=True)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    base_rows = torch.from_numpy(token_slots == 0)
    torch.testing.assert_close(got[base_rows], y[base_rows])  # the base model's rows untouched
    assert hidden < 128 or num_splits(num_tokens, hidden) > 1  # the partial sums are exercised
    assert LoRAStep.of(np.zeros(5, dtype=np.int64), slots, torch.device("cpu")) is None
    assert num_tokens < 32 or max(count for _, _, count in step.tiles) == 16 > min(count for _, _, count in step.tiles)


@pytest.mark.parametrize("slot", [0, 2])
@pytest.mark.parametrize("bias", [False, True])
def test_one_token_gemv_with_the_adapter_inline_matches_torch(slot, bias):
    """`lora_gemv`: the split-K partials (an input dim cut in three, the last part short) each
    carry their share of the delta; slot 0 (no adapter in the step) adds nothing."""
    pytest.importorskip("triton")
    from expresslane.layers.lora import LoRAStep, add_lora
    from expresslane.layers.lora_kernels import inline_block_n, lora_gemv

    torch.manual_seed(slot)
    slices, hidden = LAYOUTS["one-launch"]
    slots, rank, out = 4, 16, slices[-1][0] + slices[-1][1]
    a, b = torch.randn(slots, len(slices) * rank, hidden), torch.randn(slots, out, rank)
    a[0], b[0] = 0, 0
    weight, x = torch.randn(out, hidden), torch.randn(1, hidden)
    bias_t = torch.randn(out) if bias else None
    step = LoRAStep.of(np.array([slot]), slots, torch.device("cpu")) or LoRAStep.static(1, slots, torch.device("cpu"))
    base = torch.nn.functional.linear(x, weight, bias_t)
    want = add_lora(base.clone(), x, a, b, slices, step, use_triton=False)
    got = lora_gemv(x, weight, bias_t, a, b, slices, step, inline_block_n(weight, slices))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert slot or torch.equal(want, base)
    assert inline_block_n(weight, slices) == 64 and inline_block_n(weight[:64], LAYOUTS["per-slice"][0]) == 16
    assert inline_block_n(weight, [(0, 128), (136, 120)]) is None  # a gap between the slices


def test_step_tiles_cover_each_slots_tokens_within_the_bound():
    from expresslane.layers.lora import TILE_TOKENS, LoRAStep, max_tiles

    rng = np.random.default_rng(0)
    for _ in range(200):
        slots, tokens = int(rng.integers(2, 10)), int(rng.integers(1, 120))
        token_slots = rng.integers(0, slots, tokens) * (rng.random(tokens) < rng.random())
        step = LoRAStep.of(token_slots, slots, torch.device("cpu"), groups=False)
        if step is None:
            assert not token_slots.any()
            continue
        assert len(step.tiles) <= max_tiles(tokens, slots)
        covered = [int(step.order[first + i]) for slot, first, count in step.tiles for i in range(count)]
        assert sorted(covered) == np.flatnonzero(token_slots).tolist()  # every adapter token once, no base token
        for slot, first, count in step.tiles:
            assert 0 < count <= TILE_TOKENS and (token_slots[step.order[first:first + count]] == slot).all()
    assert max_tiles(1, 9) == 1 and max_tiles(64, 9) == 11 and max_tiles(16, 2) == 1
    if importlib.util.find_spec("triton"):  # the kernels take the step's tiles as theirs
        from expresslane.layers.lora_kernels import BLOCK_M
        assert BLOCK_M == TILE_TOKENS
