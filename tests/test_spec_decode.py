"""Speculative decoding on the shipped pair (the trained target and its draft): greedy output
identical to decoding one token at a time, alone and in mixed batches with preemption;
speculative sampling keeps the target's distribution; proposals and acceptance counted."""

import numpy as np
import pytest
import torch

from expresslane import LLM, SamplingParams
from expresslane.bench.code_corpus import stdlib_files
from expresslane.runner.ngram import ngram_propose
from expresslane.models.model_dir import DEFAULT_DRAFT_MODEL
from expresslane.runner.spec_verify import verify

ENGINE = dict(max_model_len=1024, num_kv_blocks=200, max_num_batched_tokens=256)
METHODS = {"ngram": dict(speculative_method="ngram"),
           "draft_model": dict(speculative_model=str(DEFAULT_DRAFT_MODEL))}


def test_ngram_proposals():
    assert ngram_propose([1, 2, 3, 4, 9, 1, 2, 3], 3, 2, 4) == [4, 9, 1]  # longest suffix (1 2 3) found
    assert ngram_propose([5, 1, 2, 7, 1, 2, 8, 1, 2], 2, 2, 2) == [8, 1]  # the latest occurrence
    assert ngram_propose([1, 2, 3, 4], 2, 2, 4) == []  # the suffix occurs nowhere earlier
    assert ngram_propose([1, 2, 1, 2], 5, 1, 3) == [1, 2]  # fewer tokens than asked at the end


def _prompts() -> list[str]:
    """Held-out code, some repeating part of itself (where prompt lookup pays)."""
    files = [t for _, t in stdlib_files("held-out")]
    edit = [t[:600] + "\n\n# again:\n" + t[:120] for t in files[:3]]
    return edit + [t[300:700] for t in files[3:6]] + ["def f(x):", "import os\n"]


@pytest.fixture(scope="module")
def reference():
    llm = LLM(**ENGINE)
    return llm, [o.outputs[0].token_ids for o in llm.generate(_prompts(), _greedy(32))]


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


@pytest.mark.parametrize("method", METHODS)
def test_greedy_equals_plain_decoding(method, reference):
    _, ref = reference
    llm = LLM(**ENGINE, **METHODS[method], num_speculative_tokens=4, speculative_disable_by_batch_size=64)
    prompts = _prompts()
    alone = llm.generate(prompts[:1], _greedy(32))[0].outputs[0].token_ids
    assert alone == ref[0]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, _greedy(32))]
    assert got == ref
    stats = llm.engine.core.stats()
    assert stats.spec_num_draft_tokens > 0 and 0 < stats.spec_num_accepted_tokens <= stats.spec_num_draft_tokens
    assert stats.spec_num_drafts <= stats.spec_num_draft_tokens


@pytest.mark.parametrize("method", METHODS)
def test_greedy_equal_with_preemption_and_sampling_neighbours(method, reference):
    """Few KV blocks: requests are preempted and recomputed; sampling requests run beside (seeded ones do
    not speculate: their tokens stay the same alone or in any batch)."""
    ref_llm, ref = reference
    prompts = _prompts()
    # fcfs: full-budget steps, so the preemptions do not hang on the step-cost model's timing of this
    # machine's steps (under deadline a loaded CI machine sized smaller steps and preempted nothing)
    small = dict(ENGINE, max_model_len=512, num_kv_blocks=34, max_num_seqs=8, scheduling_policy="fcfs")
    sampled = SamplingParams(temperature=1.0, max_tokens=24, seed=7, ignore_eos=True)
    unseeded = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=24, ignore_eos=True)
    llm = LLM(**small, **METHODS[method], num_speculative_tokens=3, speculative_disable_by_batch_size=64)
    outs = llm.generate(prompts + prompts[:3], [_greedy(32)] * len(prompts) + [sampled] * 2 + [unseeded])
    assert [o.outputs[0].token_ids for o in outs[:len(prompts)]] == ref
    stats = llm.engine.core.stats()
    assert stats.num_preemptions > 0 and stats.spec_num_draft_tokens > 0
    again = llm.generate(prompts[:2], [sampled] * 2)  # a seeded request's tokens do not depend on the batch
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outs[len(prompts):-1]]
    assert len(outs[-1].outputs[0].token_ids) == 24


def test_a_draft_model_left_to_the_cost_model_probes_and_keeps_greedy_output(reference):
    """No batch-size limit: the step-cost model decides, and while the draft's acceptance is the
    prior some steps speculate to measure it (probes); tokens as without speculation."""
    _, ref = reference
    llm = LLM(**ENGINE, **METHODS["draft_model"], num_speculative_tokens=4)
    assert [o.outputs[0].token_ids for o in llm.generate(_prompts()[:2], _greedy(32))] == ref[:2]
    assert llm.engine.core.stats().spec_num_drafts > 0


def test_off_at_high_batch():
    """Without a batch-size limit the step-cost model decides; with a limit below the batch nothing is proposed.
    fcfs: the four prompts start in one step and finish together (under deadline the cost model's chunks
    staggered them, and the last two decoded alone, under the limit)."""
    llm = LLM(**ENGINE, speculative_method="ngram", speculative_disable_by_batch_size=2, scheduling_policy="fcfs")
    llm.generate(_prompts()[:4], _greedy(8))  # four decode together: over the limit until some finish
    stats = llm.engine.core.stats()
    assert stats.spec_num_draft_tokens == 0


def _chi2_ok(samples: np.ndarray, probs: np.ndarray) -> bool:
    """Pearson's chi-square against the expected counts, at p ~ 1e-4 (the critical value for the df)."""
    counts = np.bincount(samples, minlength=len(probs))
    expected = probs * len(samples)
    keep = expected > 5
    stat = (((counts - expected) ** 2)[keep] / expected[keep]).sum() + counts[~keep].sum()
    df = keep.sum() - 1
    return stat < df + 6 * np.sqrt(2 * df) + 10


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_speculative_sampling_keeps_the_target_distribution(proposer):
    """20,000 independent verifications of k = 2 proposals on fixed logits: the first token is
    distributed as p at position 0, and the second (when the first proposal was accepted) as
    p at position 1, whatever the proposals."""
    torch.manual_seed(0)
    vocab, k, n = 6, 2, 20000
    target = torch.randn(k + 1, vocab) * 1.5
    p = target.softmax(-1).numpy()
    gen = torch.Generator().manual_seed(1)
    if proposer == "ngram":  # deterministic proposals (one-hot q): the token 0 then 1
        drafts = torch.tensor([[0, 1]]).repeat(n, 1)
        q = None
    else:  # drawn from a draft distribution q (different from p)
        q_logits = torch.randn(k, vocab)
        q1 = q_logits.softmax(-1)
        drafts = torch.stack([torch.multinomial(q1[j], n, replacement=True, generator=gen) for j in range(k)], 1)
        q = q1[None].repeat(n, 1, 1)
    logits = target[None].repeat(n, 1, 1)
    params = [SamplingParams(temperature=1.0)] * n
    got = verify(logits, np.full(n, k), drafts, params, gen, q).tokens()
    counts = np.array([len(t) for t in got])
    tokens = np.array([t + [-1] * (k + 1 - len(t)) for t in got])
    assert _chi2_ok(tokens[:, 0], p[0])
    second = tokens[counts >= 2, 1]  # the first token was the accepted proposal
    first_accepted = tokens[counts >= 2, 0]
    for tok in np.unique(first_accepted):
        sel = second[first_accepted == tok]
        if len(sel) > 500:
            assert _chi2_ok(sel, p[1])
    assert set(counts.tolist()) <= {1, 2, 3} and (tokens[np.arange(n), counts - 1] >= 0).all()


@pytest.mark.parametrize("on_device", [False, True], ids=["host-drafts", "device-drafts"])
def test_greedy_verification_stops_at_the_first_mismatch(on_device):
    vocab = 5
    logits = torch.full((1, 3, vocab), -5.0)
    logits[0, 0, 2] = logits[0, 1, 4] = logits[0, 2, 1] = 5.0  # argmax per position: 2, 4, 1
    params = [SamplingParams(temperature=0)]
    for drafts, want in (([2, 4], [2, 4, 1]), ([2, 3], [2, 4]), ([0, 4], [2])):
        drafts = torch.tensor([drafts]) if on_device else np.array([drafts])
        assert verify(logits, np.array([2]), drafts, params, torch.Generator()).tokens() == [want]


def test_greedy_and_sampling_verification_of_seqs_with_fewer_proposals_than_the_widest():
    """Two seqs, 3 and 1 proposals: the second's rows are padded by repeating its last one, and its
    padding never counts as accepted (greedy on the host, and the device path beside a sampling seq)."""
    vocab = 6
    logits = torch.full((2, 4, vocab), -9.0)
    for j, t in enumerate([1, 2, 3, 4]):
        logits[0, j, t] = 9.0
    logits[1, :, 5] = 9.0  # argmax 5 at its last known token and at its padding rows
    drafts = np.array([[1, 2, 0], [5, 5, 5]])  # seq 1: one proposal (5), then padding equal to the argmax
    greedy = [SamplingParams(temperature=0)] * 2
    assert verify(logits, np.array([3, 1]), drafts, greedy, torch.Generator()).tokens() == [[1, 2, 3], [5, 5]]
    peaked = [SamplingParams(temperature=0), SamplingParams(temperature=1e-3)]  # sampling, near-greedy
    assert verify(logits, np.array([3, 1]), drafts, peaked, torch.Generator()).tokens() == [[1, 2, 3], [5, 5]]


def test_benchmark_reports_acceptance_on_held_out_code(tmp_path):
    """benchmarks/spec_decode_bench.py at a CPU size: rows for each method, greedy tokens equal."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    out = tmp_path / "rows.jsonl"
    subprocess.run([sys.executable, "spec_decode_bench.py", "--methods", "none,ngram", "--batch-sizes", "1,3",
                    "--num-prompts", "3", "--max-tokens", "12", "--prompt-tokens", "96",
                    "--speculative-disable-by-batch-size", "8", "--out", str(out)],
                   cwd=root / "benchmarks", check=True, capture_output=True, timeout=600)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    [decision] = [r for r in rows if r["bench"] == "spec_decision"]  # what the step-cost model weighed
    assert decision["method"] == "ngram" and 0 <= decision["acceptance"] <= 1
    assert set(decision["predicted_ms_per_token_plain_spec"]) == {"batch_1", "batch_3"}  # (values: a fit of
    # timings on a loaded CPU, any sign)
    rows = [r for r in rows if r["bench"] == "spec_decode"]
    assert {(r["method"], r["workload"], r["batch"]) for r in rows} == {
        (m, w, b) for m in ("none", "ngram") for w in ("completion", "edit") for b in (1, 3)}
    spec = [r for r in rows if r["method"] == "ngram"]
    assert all(r["same_tokens_as_none"] and r["speedup"] > 0 for r in spec)
    assert all(0 <= r["acceptance_rate"] <= 1 and r["verifies"] > 0 for r in spec)


def test_verify_steps_through_the_graph_input_path(tmp_path):
    """The triton backend (Triton's interpreter on CPU) with the mixed-step graphs' static buffers:
    verify steps take their logits rows from the graph path, proposals patched in on the device;
    the draft's forwards go through its own graphs' buffers (a catch-up pass through the mixed
    ones; greedy proposals 2..k through the chain, each fed the argmax before it on the device;
    a sampling request's through the decode ones); greedy tokens as without speculation, with
    the two requests ending apart (near its end a request proposes fewer: the chain must not
    write past its slots). A tiny random model (the interpreter is slow) as its own draft, so
    every greedy proposal is accepted. (Prompt lookup differs only in where proposals come from.)"""
    pytest.importorskip("triton")
    from models import build_model

    model = str(build_model("llama", tmp_path / "m"))
    engine = dict(attention_backend="triton", max_model_len=128, num_kv_blocks=24, max_num_seqs=4,
                  max_num_batched_tokens=64)
    prompts = [{"prompt_token_ids": [5, 6, 7, 8, 9, 5, 6, 7]}, {"prompt_token_ids": list(range(20, 50))}]
    params = [_greedy(11), _greedy(7)]
    runs, chains = [], []
    for extra in ({}, dict(speculative_model=model, num_speculative_tokens=3, speculative_disable_by_batch_size=8)):
        llm = LLM(model, **engine, **extra)
        llm.engine.runner.build_graphs(128, capture=False)
        draft = llm.engine.runner.proposer
        if draft is not None:  # count the chain's replays
            run_chain = draft.chain_graphs.run_chain
            draft.chain_graphs.run_chain = lambda *a: (chains.append(a[2].copy()), run_chain(*a))[1]
        runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
    assert runs[0] == runs[1]
    stats = llm.engine.core.stats()
    assert stats.spec_num_draft_tokens > 0 and stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens
    assert chains and any(len(set(c.tolist())) > 1 for c in chains)  # seqs of different counts in one chain
    assert draft.chain_graphs.positions.any() and draft.mixed_graphs.positions.any()  # both buffers were fed
    sampled = llm.generate(prompts[:1], SamplingParams(temperature=0.8, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert len(sampled[0].outputs[0].token_ids) == 6 and draft.decode_graphs.positions.any()


@pytest.mark.parametrize("mode", [dict(speculative_disable_by_batch_size=2),
                                  dict(speculative_disable_by_batch_size=3, batching="static", max_batch_size=4),
                                  dict(speculative_disable_by_batch_size=2, scheduling_policy="deadline"),
                                  dict(speculative_disable_by_batch_size=2, speculative_method="draft_model",
                                       speculative_model=str(DEFAULT_DRAFT_MODEL))])
def test_speculation_turning_on_and_off_keeps_greedy_output(mode, reference):
    """Requests of different lengths: speculation is off while more than the limit decode and on
    once they finish (steps in flight are landed before a speculating plan; a draft model then
    catches up on the tokens it did not compute); same tokens."""
    _, ref = reference
    prompts = _prompts()
    lengths = [8, 32, 12, 28, 16, 24, 10, 20]
    llm = LLM(**ENGINE, num_speculative_tokens=4, **{"speculative_method": "ngram", **mode})
    outs = llm.generate(prompts, [_greedy(n) for n in lengths])
    assert [o.outputs[0].token_ids for o in outs] == [r[:n] for r, n in zip(ref, lengths)]
    assert llm.engine.core.stats().spec_num_draft_tokens > 0


def test_the_draft_chain_writes_only_the_slots_of_the_proposals_a_seq_makes(tmp_path):
    """Two seqs in one chain replay: A proposes 3 (the chain feeds proposals 1 and 2 at positions
    5 and 6), B proposes 1 (the chain feeds it nothing) from the model's last position (1023,
    the last slot of block 3). The draft's cache gets A's two positions and nothing else: B
    neither writes into the table's padding (block 0, another request's) nor moves past the
    rotary table."""
    pytest.importorskip("triton")
    from models import build_model

    from expresslane.contract import ScheduledSeq
    from expresslane.runner.cuda_graphs import DraftChainGraphs, Patch
    from expresslane.runner.draft_model import DraftModelProposer
    from expresslane.runner.request_rows import StepInputs

    model_dir = build_model("llama", tmp_path / "m")
    cpu = torch.device("cpu")
    draft = DraftModelProposer(model_dir, 512, cpu, torch.float32, "triton", 3)
    draft.allocate_kv_cache(8, 16, torch.float32)
    logits_out = torch.empty(4, 512)
    chain = DraftChainGraphs(draft.model, draft.backend, 4, 64, cpu, logits_out, steps=2, block_size=16)
    table = np.zeros((2, 64), np.int32)
    table[0, :2], table[1, 63] = (1, 2), 3  # (B's other blocks: in the test, none of its own)
    seqs = [ScheduledSeq("a", [0], 5, [], True), ScheduledSeq("b", [0], 1023, [], True)]
    step = StepInputs(seqs=seqs, rows=np.arange(2), token_ids=np.zeros(2, np.int64), positions=np.array([5, 1023]),
                      rope_lengths=np.zeros(2, np.int64),
                      slot_mapping=np.array([[16 + 5, 48 + 15]]), query_start_loc=np.arange(3, dtype=np.int32),
                      seq_lens=np.array([6, 1024], np.int32), block_tables=table[None], num_decodes=2,
                      sampling=np.arange(2), from_previous=np.arange(0), num_spec=np.zeros(2, np.int64))
    tokens = chain.run_chain(step, Patch(np.arange(2), np.arange(2), torch.tensor([7, 9])), np.array([3, 1]))
    assert tokens.shape == (2, 2)
    for layer in draft.model.layers:
        cache = layer.self_attn.kv_cache  # [2, blocks, 16, kv heads, head dim]
        written = cache.abs().sum(dim=(0, 3, 4)) != 0  # [blocks, slots]
        assert written[1].nonzero().flatten().tolist() == [5, 6]
        assert not written[torch.tensor([0, 2, 3, 4, 5, 6, 7])].any()


def test_step_phases_benchmark_times_the_verify_phases(tmp_path):
    """benchmarks/step_phases.py at a CPU size: every phase timed, the verify ones only with speculation."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    out = tmp_path / "rows.jsonl"
    subprocess.run([sys.executable, "step_phases.py", "--prompts", "2", "--max-tokens", "32", "--out", str(out)],
                   cwd=root / "benchmarks", check=True, capture_output=True, timeout=600)
    none, ngram = [json.loads(line) for line in out.read_text().splitlines()]
    assert none["method"] == "none" and ngram["method"] == "ngram"
    common = {"core_step", "schedule", "update", "execute", "rows_apply", "output_process", "result_get"}
    assert common <= set(none["phases"]) and not {"verify_forward", "verify_accept"} & set(none["phases"])
    assert {"verify_forward", "verify_accept"} <= set(ngram["phases"]) and ngram["steps"] < none["steps"]
    assert all(p["calls"] > 0 and p["mean_us"] > 0 for r in (none, ngram) for p in r["phases"].values())
