"""load_tokenizer bounds the Rust model's word cache: a first-come cache that never evicts, which
clients fill with words that never come again (tokenizer.py, WORD_CACHE_WORDS)."""

import random
import string
from types import SimpleNamespace

from tokenizers import Tokenizer

import expresslane.tokenizer as tokenizer_module
from expresslane.models.model_dir import DEFAULT_MODEL
from expresslane.tokenizer import WORD_CACHE_WORDS, bound_word_cache, load_tokenizer


def test_load_tokenizer_bounds_the_word_cache(monkeypatch):
    bounded = []
    monkeypatch.setattr(tokenizer_module, "bound_word_cache", lambda tok: bounded.append(tok) or tok)
    tok = load_tokenizer(DEFAULT_MODEL)
    assert bounded == [tok]


def test_bound_word_cache_resizes_the_rust_models_cache():
    sizes = []
    tok = SimpleNamespace(backend_tokenizer=SimpleNamespace(model=SimpleNamespace(_resize_cache=sizes.append)))
    assert bound_word_cache(tok) is tok and sizes == [WORD_CACHE_WORDS]
    bound_word_cache(tok, 7)
    assert sizes == [WORD_CACHE_WORDS, 7]
    plain = SimpleNamespace(encode=str.split)  # no Rust backend, or a model without a cache: left as it is
    assert bound_word_cache(plain) is plain
    no_cache = SimpleNamespace(backend_tokenizer=SimpleNamespace(model=SimpleNamespace()))
    assert bound_word_cache(no_cache) is no_cache


def test_a_full_bounded_cache_gives_the_same_tokens():
    rng = random.Random(0)
    words = [" " + "".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 40)))
             for _ in range(3 * WORD_CACHE_WORDS)]
    text = "".join(words) + " " + str(rng.random())
    bounded = load_tokenizer(DEFAULT_MODEL).backend_tokenizer
    unbounded = Tokenizer.from_file(str(DEFAULT_MODEL / "tokenizer.json"))
    for word in words:  # more distinct words than the bounded cache holds
        assert bounded.encode(word).ids == unbounded.encode(word).ids
    assert bounded.encode(text).ids == unbounded.encode(text).ids
