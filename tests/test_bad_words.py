"""vLLM's ``bad_words`` on the built-in model, greedy: a one-token word never appears, a longer
word's last token is banned only right after the rest of it, a neighbour without bad words is
unchanged, and the words are tokenized as vLLM does (runner/bad_words.py)."""

from __future__ import annotations

import pytest

from expresslane import LLM, SamplingParams
from expresslane.sampling_params import SamplingParamError

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def llm():
    return LLM()


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def plain(llm) -> list[int]:
    return llm.generate(PROMPT, _greedy())[0].outputs[0].token_ids


def test_words_are_tokenized_alone_and_after_a_space(llm):
    tok = llm.engine.tokenizer
    sp = _greedy(bad_words=["servers", " server"])
    sp.update_from_tokenizer(tok)
    enc = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    assert sp.bad_words_token_ids == [enc("servers"), enc(" servers"), enc("server"), enc(" server")]
    assert len(enc("servers")) == 2 and len(enc(" server")) == 1


def test_a_one_token_word_never_appears(llm, plain):
    banned = llm.engine.tokenizer.encode(" server", add_special_tokens=False)[0]
    first = plain.index(banned)
    out = llm.generate(PROMPT, _greedy(bad_words=["server"]))[0].outputs[0].token_ids
    assert out[:first] == plain[:first] and banned not in out


def test_a_longer_word_bans_its_last_token_after_the_rest_only(llm, plain):
    enc = lambda text: llm.engine.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    head, last = enc(" servers")
    at = next(i for i in range(1, len(plain)) if plain[i - 1:i + 1] == [head, last])
    assert plain[:at].count(head) > 1  # the word's first token alone stays allowed
    mixed = llm.generate([PROMPT, PROMPT], [_greedy(), _greedy(bad_words=["servers"])])
    out = mixed[1].outputs[0].token_ids
    assert out[:at] == plain[:at] and out[at] != last
    assert all(out[i - 1:i + 1] != [head, last] for i in range(1, len(out)))
    assert mixed[0].outputs[0].token_ids == plain


def test_a_word_without_tokens_is_refused(llm):
    with pytest.raises(SamplingParamError, match="bad_words"):
        _greedy(bad_words=["  "])
    with pytest.raises(ValueError, match="bad_words"):
        llm.generate(PROMPT, _greedy(bad_words=[1]))


def test_refused_with_speculative_decoding():
    llm = LLM(speculative_method="ngram")
    with pytest.raises(ValueError, match="bad_words: not supported with speculative decoding"):
        llm.generate(PROMPT, _greedy(bad_words=["server"]), use_tqdm=False)


def test_a_readmitted_request_keeps_its_outputs_history():
    """A preempted request comes back with its outputs (NewRequest.token_ids): a word begun before
    the preemption is still caught; prompt tokens do not count (vLLM's: the output only)."""
    import torch

    from expresslane.contract import NewRequest
    from expresslane.runner.bad_words import BadWords

    sp = SamplingParams(bad_words=["x"], bad_words_token_ids=[[5, 6, 7], [9]])
    words = BadWords(4, torch.device("cpu"))
    words.add(1, NewRequest("a", sp, num_prompt_tokens=2, token_ids=[5, 6, 1, 5, 6]))
    words.add(2, NewRequest("b", sp, num_prompt_tokens=2, token_ids=[5, 6]))
    logits = torch.zeros(2, 10)
    words.apply(logits, [1, 2])
    assert torch.isinf(logits[0, [7, 9]]).all() and torch.isinf(logits[1, 9]) and not torch.isinf(logits[1, 7])
    words.sampled([2, 1], torch.tensor([5, 3]))
    words.sampled([2, 1], torch.tensor([6, 3]))
    logits = torch.zeros(2, 10)
    words.apply(logits, [2, 1])
    assert torch.isinf(logits[0, 7]) and not torch.isinf(logits[1, 7]) and torch.isinf(logits[:, 9]).all()
