"""Prompt logprobs (vLLM's `prompt_logprobs`) equal transformers' log-softmax of the prompt, in
float32 on CPU: in one step, in chunks, past a prefix-cache hit (the cache is bypassed), after
preemption, with n > 1; ranks and top-k as vLLM gives them; requests without them unchanged."""

import random

import pytest
import torch
from models import build_model, hf_greedy

from expresslane import LLM, SamplingParams
from expresslane.runner import model_runner

ATOL = 1e-4  # float32, different kernels: the reference's own logits differ from ours by ~1e-6


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model("llama", tmp_path_factory.mktemp("plp") / "llama")


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(500) for _ in range(n)]


_REFS: dict[tuple, torch.Tensor] = {}


def reference(model_dir, ids: list[int]) -> torch.Tensor:
    """transformers' log-softmax at each prompt position, [len(ids), vocab]."""
    from transformers import AutoModelForCausalLM

    key = (str(model_dir), tuple(ids))
    if key not in _REFS:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        with torch.no_grad():
            _REFS[key] = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    return _REFS[key]


def check(model_dir, ids: list[int], plp, k: int) -> None:
    """Every position: the prompt token's logprob and rank, and the top k (ids, values, ranks 1..k)."""
    ref = reference(model_dir, ids)
    assert plp is not None and len(plp) == len(ids) and plp[0] is None
    for i in range(1, len(ids)):
        row, tok, entry = ref[i - 1], ids[i], plp[i]
        assert entry[tok].logprob == pytest.approx(row[tok].item(), abs=ATOL), f"position {i}"
        lo = int((row > row[tok] + ATOL).sum()) + 1  # the rank, whatever near-ties do
        hi = int((row >= row[tok] - ATOL).sum())
        assert lo <= entry[tok].rank <= hi, f"position {i}: rank {entry[tok].rank} not in [{lo}, {hi}]"
        want = row.topk(k)
        want_ids, want_lps = want.indices.tolist(), want.values.tolist()
        assert len(entry) == k + (tok not in want_ids), f"position {i}: {len(entry)} entries"
        best = sorted(entry.items(), key=lambda kv: -kv[1].logprob)[:k]
        for (t, lp), want_t, want_lp in zip(best, want_ids, want_lps):
            assert lp.logprob == pytest.approx(want_lp, abs=ATOL)
            assert t == want_t or abs(row[t] - want_lp) <= ATOL  # a near-tie may swap two ids
        top_ranks = sorted(lp.rank for t, lp in entry.items() if t != tok)
        assert top_ranks == [r for r in range(1, k + 1) if want_ids[r - 1] != tok]  # the top k's: 1..k


def test_equal_transformers_in_one_step(model_dir):
    llm = LLM(str(model_dir))
    prompts = [prompt(n, n) for n in (1, 2, 17, 100)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=4), use_tqdm=False)
    for p, out in zip(prompts, outs):
        check(model_dir, p, out.prompt_logprobs, 4)
        assert all(out.prompt_logprobs[i][p[i]].decoded_token == llm.tokenizer.decode([p[i]]) for i in range(1, len(p)))


def test_chunked_prefill_scores_across_chunk_boundaries(model_dir, monkeypatch):
    llm = LLM(str(model_dir), max_num_batched_tokens=16, scheduling_policy="fcfs")
    chunks: list[tuple[int, int, int]] = []  # (start, tokens, positions scored) of each chunk
    runner = llm.engine.runner
    execute = runner.execute

    def spy(plan):
        chunks.extend((s.start_pos, len(s.token_ids), len(s.prompt_logprob_targets)) for s in plan.seqs)
        return execute(plan)

    monkeypatch.setattr(runner, "execute", spy)
    p = prompt(61, 7)
    [out] = llm.generate([{"prompt_token_ids": p}], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0),
                         use_tqdm=False)
    check(model_dir, p, out.prompt_logprobs, 0)
    prefill = [c for c in chunks if c[2]]
    assert len(prefill) == 4 and [c[0] for c in prefill] == [0, 16, 32, 48]
    assert [c[2] for c in prefill] == [16, 16, 16, 12]  # each chunk's last token scores the next chunk's first
    assert out.outputs[0].token_ids == hf_greedy(model_dir, p, 2)


def test_prefix_cache_hit_is_bypassed_and_exact(model_dir):
    llm = LLM(str(model_dir), enable_prefix_caching=True, scheduling_policy="fcfs")
    shared = prompt(64, 3)
    greedy = SamplingParams(temperature=0, max_tokens=2)
    [first] = llm.generate([{"prompt_token_ids": shared + [1, 2, 3]}], greedy, use_tqdm=False)
    assert first.prompt_logprobs is None
    p = shared + prompt(9, 4)
    [scored] = llm.generate([{"prompt_token_ids": p}], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2),
                            use_tqdm=False)
    check(model_dir, p, scored.prompt_logprobs, 2)
    assert scored.num_cached_tokens == 0  # computed in full: a cached prefix has no logits
    [plain] = llm.generate([{"prompt_token_ids": p}], greedy, use_tqdm=False)
    assert plain.num_cached_tokens >= 64  # the cache held it: the request above bypassed it
    assert plain.outputs[0].token_ids == scored.outputs[0].token_ids


def test_preemption_scores_each_position_once(model_dir):
    llm = LLM(str(model_dir), max_num_batched_tokens=64, max_model_len=512, num_kv_blocks=32,
              enable_prefix_caching=True, scheduling_policy="fcfs")
    prompts = [prompt(n, 100 + n) for n in (120, 130, 140, 150)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, prompt_logprobs=1),
                        use_tqdm=False)
    assert llm.engine.core.scheduler.num_preemptions > 0
    for p, out in zip(prompts, outs):
        check(model_dir, p, out.prompt_logprobs, 1)
        assert out.outputs[0].token_ids == hf_greedy(model_dir, p, 40)


def test_n_completions_share_one_prompt_score(model_dir):
    llm = LLM(str(model_dir))
    p = prompt(40, 11)
    [out] = llm.generate([{"prompt_token_ids": p}], SamplingParams(n=3, seed=5, max_tokens=4, prompt_logprobs=3),
                         use_tqdm=False)
    assert len(out.outputs) == 3
    check(model_dir, p, out.prompt_logprobs, 3)


def test_requests_without_it_take_no_extra_path(model_dir, monkeypatch):
    calls = []
    real = model_runner.forward_scoring
    monkeypatch.setattr(model_runner, "forward_scoring", lambda *a: calls.append(1) or real(*a))
    llm = LLM(str(model_dir), max_num_batched_tokens=32)
    prompts = [prompt(n, n + 50) for n in (5, 50)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=5),
                        use_tqdm=False)
    assert not calls and all(o.prompt_logprobs is None for o in outs)
    mixed = llm.generate([{"prompt_token_ids": p} for p in prompts],
                         [SamplingParams(temperature=0, max_tokens=5),
                          SamplingParams(temperature=0, max_tokens=5, prompt_logprobs=1)], use_tqdm=False)
    assert calls  # the request that asks runs the scoring path; the other beside it is unchanged
    assert mixed[0].prompt_logprobs is None
    check(model_dir, prompts[1], mixed[1].prompt_logprobs, 1)
    assert [o.outputs[0].token_ids for o in mixed] == [o.outputs[0].token_ids for o in outs]
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(model_dir, p, 5) for p in prompts]


def test_bad_values_and_speculative_decoding_refused(model_dir):
    with pytest.raises(ValueError, match="prompt_logprobs must be an integer >= 0"):
        SamplingParams(prompt_logprobs=-1)
    llm = LLM(str(model_dir), speculative_method="ngram")
    with pytest.raises(ValueError, match="prompt_logprobs: not supported with speculative decoding"):
        llm.generate([{"prompt_token_ids": prompt(5, 1)}], SamplingParams(prompt_logprobs=1), use_tqdm=False)


def test_tensor_parallel(model_dir):
    """Every rank computes the scored positions' logits (a collective gathers the vocabulary's
    shards); rank 0's are returned."""
    llm = LLM(str(model_dir), tensor_parallel_size=2, max_num_batched_tokens=32, scheduling_policy="fcfs")
    p = prompt(70, 21)
    try:
        [out] = llm.generate([{"prompt_token_ids": p}], SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2),
                             use_tqdm=False)
    finally:
        llm.shutdown()
    check(model_dir, p, out.prompt_logprobs, 2)
