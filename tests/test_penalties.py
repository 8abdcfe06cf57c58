"""Presence, frequency and repetition penalties (vLLM's meanings) match a reference written here
over transformers' logits, greedy, token for token; they hold across chunked prefill and
preemption; a request without them is unchanged beside one with them."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from expresslane import LLM, SamplingParams
from models import _hf_model


def reference(model_dir, prompt: list[int], n: int, presence: float, frequency: float, repetition: float) -> list[int]:
    """Greedy decoding with the penalties applied to transformers' float32 logits, step by step:
    repetition over prompt and output tokens (divide a positive logit, multiply a negative one),
    then frequency (per occurrence) and presence (once) over output tokens."""
    model = _hf_model(model_dir)
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            for t in set(ids):
                logits[t] = logits[t] / repetition if logits[t] > 0 else logits[t] * repetition
            for t, c in Counter(out).items():
                logits[t] = logits[t] - frequency * c - presence
            tok = int(logits.argmax())
            out.append(tok)
            ids.append(tok)
    return out


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 300) for _ in range(n)]


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir), max_num_batched_tokens=32, scheduling_policy="fcfs")


@pytest.mark.parametrize("presence, frequency, repetition", [
    (0.0, 0.0, 1.3), (1.5, 0.0, 1.0), (0.0, 0.8, 1.0), (0.5, 0.5, 1.2), (-1.0, 0.0, 0.8)])
def test_greedy_with_penalties_matches_the_reference(llm, llama_dir, presence, frequency, repetition):
    p = prompt(45, 1)  # longer than a step's 32 tokens: chunked prefill
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, presence_penalty=presence,
                        frequency_penalty=frequency, repetition_penalty=repetition)
    [out] = llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)
    assert out.outputs[0].token_ids == reference(llama_dir, p, 24, presence, frequency, repetition)


def test_penalties_change_the_output_and_leave_neighbours_alone(llm):
    p = prompt(20, 2)
    plain = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    penalized = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, frequency_penalty=2.0)
    [alone] = llm.generate([{"prompt_token_ids": p}], plain, use_tqdm=False)
    both = llm.generate([{"prompt_token_ids": p}] * 2, [plain, penalized], use_tqdm=False)
    assert both[0].outputs[0].token_ids == alone.outputs[0].token_ids
    assert both[1].outputs[0].token_ids != alone.outputs[0].token_ids
    assert max(Counter(both[1].outputs[0].token_ids).values()) <= max(Counter(alone.outputs[0].token_ids).values())


def test_penalties_survive_preemption(llama_dir):
    """Few KV blocks: requests are preempted and recomputed; their outputs' counts come back."""
    small = LLM(str(llama_dir), num_kv_blocks=24, max_model_len=128, max_num_batched_tokens=64, scheduling_policy="fcfs")
    prompts = [prompt(40, s) for s in range(4)]
    sp = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True, presence_penalty=0.7, frequency_penalty=0.3,
                        repetition_penalty=1.1)
    outs = small.generate([{"prompt_token_ids": x} for x in prompts], sp, use_tqdm=False)
    assert small.engine.core.scheduler.num_preemptions > 0
    for x, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == reference(llama_dir, x, 60, 0.7, 0.3, 1.1)


def test_the_penalty_kernel_equals_the_torch_ops():
    """runner/penalty_kernel.py (the CUDA path) under Triton's interpreter (conftest), against the torch ops."""
    from expresslane.contract import NewRequest
    from expresslane.runner.penalties import Penalties
    from expresslane.runner.penalty_kernel import penalize

    gen = torch.Generator().manual_seed(0)
    pen = Penalties(6, 1500, torch.device("cpu"))
    rows = [4, 0, 2]
    for row, (p, f, r) in zip(rows, [(0.5, 0.3, 1.2), (-1.0, 0.0, 0.8), (0.0, 2.0, 1.0)]):
        tokens = torch.randint(0, 1500, (300,), generator=gen).tolist()
        pen.add(row, NewRequest(f"r{row}", SamplingParams(presence_penalty=p, frequency_penalty=f, repetition_penalty=r),
                                num_prompt_tokens=120, token_ids=tokens))
    logits = torch.randn(4, 1500, generator=gen)  # logits row 3 is not penalized
    want = logits.clone()
    pen.apply(want, rows + [5])  # the torch ops (CPU)
    got = logits.clone()
    params = [pen.params[r] for r in rows]
    penalize(got, pen.counts, pen.seen, torch.tensor([0, 1, 2]), torch.tensor(rows),
             torch.tensor([p.repetition_penalty for p in params]), torch.tensor([p.frequency_penalty for p in params]),
             torch.tensor([p.presence_penalty for p in params]))
    assert torch.equal(got, want) and torch.equal(got[3], logits[3])
