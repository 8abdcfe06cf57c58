"""Sampling semantics: seeds, n, stop strings and tokens, min_tokens, logprobs, top_p, min_p."""

import math
import random

import pytest

from expresslane import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir), max_num_batched_tokens=32)


def ids(n, seed):
    rng = random.Random(seed)
    return {"prompt_token_ids": [rng.randrange(500) for _ in range(n)]}


def test_seeded_sampling_same_alone_and_in_batch(llm):
    sp = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=123, max_tokens=24, ignore_eos=True)
    target = ids(40, 0)
    [alone] = llm.generate([target], sp, use_tqdm=False)
    others = [ids(n, i + 1) for i, n in enumerate((5, 90, 17, 60, 33, 120))]
    batch = others[:3] + [target] + others[3:]
    params = [SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True, seed=(i if i % 2 else None))
              for i in range(len(others))]
    params.insert(3, sp)
    together = llm.generate(batch, params, use_tqdm=False)
    assert together[3].outputs[0].token_ids == alone.outputs[0].token_ids
    # and the sampler really samples: another seed gives another sequence
    [other_seed] = llm.generate([target], SamplingParams(**{**_fields(sp), "seed": 124}), use_tqdm=False)
    assert other_seed.outputs[0].token_ids != alone.outputs[0].token_ids


def _fields(sp):
    return {k: getattr(sp, k) for k in ("temperature", "top_p", "top_k", "max_tokens", "ignore_eos")}


def test_n_completions_are_distinct_and_reproducible(llm):
    sp = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    [a] = llm.generate([ids(20, 5)], sp, use_tqdm=False)
    [b] = llm.generate([ids(20, 5)], sp, use_tqdm=False)
    assert [c.index for c in a.outputs] == [0, 1, 2]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({tuple(c.token_ids) for c in a.outputs}) == 3


def test_top_k_one_is_greedy(llm):
    prompt = ids(30, 9)
    [greedy] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    [k1] = llm.generate([prompt], SamplingParams(temperature=0.8, top_k=1, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)
    assert k1.outputs[0].token_ids == greedy.outputs[0].token_ids


def test_stop_token_ids_and_eos(llm):
    prompt = ids(30, 11)
    [free] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    toks = free.outputs[0].token_ids
    stop_tok = toks[4]
    [stopped] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_tok]),
                             use_tqdm=False)
    out = stopped.outputs[0]
    first = toks.index(stop_tok)
    assert out.token_ids == toks[:first + 1] and out.finish_reason == "stop" and out.stop_reason == stop_tok
    # min_tokens bans the stop token until enough tokens exist
    [late] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_tok],
                                                   min_tokens=first + 2), use_tqdm=False)
    assert len(late.outputs[0].token_ids) >= first + 2
    assert stop_tok not in late.outputs[0].token_ids[:first + 2]


def test_stop_string_cuts_text(llm):
    prompt = "Hello there, how are you"
    [free] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False)
    text = free.outputs[0].text
    assert len(text) > 6
    stop = text[3:6]
    [cut] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop]),
                         use_tqdm=False)
    out = cut.outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[:text.index(stop)]
    assert len(out.token_ids) < 30


def test_detokenized_text_matches_full_decode(llm):
    [out] = llm.generate(["The quick brown fox"], SamplingParams(temperature=1.0, seed=3, max_tokens=40,
                                                                 ignore_eos=True), use_tqdm=False)
    comp = out.outputs[0]
    assert comp.text == llm.tokenizer.decode(comp.token_ids, skip_special_tokens=True).rstrip("\ufffd")


def test_logprobs(llm):
    [out] = llm.generate([ids(10, 2)], SamplingParams(temperature=0, max_tokens=5, logprobs=3, ignore_eos=True),
                         use_tqdm=False)
    comp = out.outputs[0]
    assert len(comp.logprobs) == 5
    for tok, lp in zip(comp.token_ids, comp.logprobs):
        assert tok in lp and len(lp) in (3, 4)
        assert max(lp, key=lp.get) == tok  # greedy picks the most likely token
        assert all(v <= 0 for v in lp.values()) and math.isfinite(lp[tok])


def test_metrics_are_ordered(llm):
    [out] = llm.generate([ids(50, 4)], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    m = out.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time


# -- the sampler's filters on a known distribution (no model) ---------------------------------
PROBS = [0.5, 0.3, 0.15, 0.05]


def sample_counts(rows: int = 4000, **params) -> list[int]:
    """How often each token of PROBS is drawn in `rows` independent samples (seeded)."""
    import torch

    from expresslane.runner.sampler import Sampler, SamplingBatch

    sampler = Sampler(torch.device("cpu"), seed=0)
    logits = torch.tensor(PROBS).log().repeat(rows, 1)
    sp = SamplingParams(temperature=1.0, **params)
    tokens, _ = sampler(logits, SamplingBatch([sp] * rows, [()] * rows, [None] * rows))
    return torch.bincount(tokens, minlength=len(PROBS)).tolist()


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    assert all(sample_counts(top_p=1.0))  # no filter: every token is drawn
    counts = sample_counts(top_p=0.7)  # 0.5 < 0.7 <= 0.5 + 0.3: the two most likely tokens
    assert counts[2:] == [0, 0]
    assert counts[0] / 4000 == pytest.approx(0.5 / 0.8, abs=0.03)  # renormalised over the kept ones
    counts = sample_counts(top_p=0.81)  # a token is kept while the mass before it is < p
    assert counts[2] > 0 and counts[3] == 0
    assert sample_counts(top_p=0.3) == [4000, 0, 0, 0]  # the top token always stays


def test_min_p_drops_tokens_below_a_fraction_of_the_top_one():
    counts = sample_counts(min_p=0.2)  # threshold 0.2 * 0.5 = 0.1: the 0.05 token goes
    assert counts[3] == 0 and all(counts[:3])
    assert counts[2] / 4000 == pytest.approx(0.15 / 0.95, abs=0.03)
    counts = sample_counts(min_p=0.5)  # threshold 0.25: two tokens stay
    assert counts[2:] == [0, 0] and counts[0] / 4000 == pytest.approx(0.5 / 0.8, abs=0.03)
    assert sample_counts(min_p=1.0) == [4000, 0, 0, 0]


def test_top_p_and_min_p_compose_with_top_k_per_row():
    """Filters apply per row: one row's top_p does not touch its neighbour's distribution."""
    import torch

    from expresslane.runner.sampler import Sampler, SamplingBatch

    sampler = Sampler(torch.device("cpu"), seed=0)
    rows = 3000
    params = [SamplingParams(temperature=1.0, top_p=0.7), SamplingParams(temperature=1.0),
              SamplingParams(temperature=1.0, top_k=3, min_p=0.2)] * rows
    logits = torch.tensor(PROBS).log().repeat(3 * rows, 1)
    tokens, _ = sampler(logits, SamplingBatch(params, [()] * len(params), [None] * len(params)))
    per_kind = [torch.bincount(tokens[i::3], minlength=4).tolist() for i in range(3)]
    assert per_kind[0][2:] == [0, 0] and all(per_kind[1]) and per_kind[2][3] == 0 and all(per_kind[2][:3])
