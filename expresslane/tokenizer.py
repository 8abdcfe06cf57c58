"""Tokenizer loading (transformers) and the EOS ids a model stops on."""

from __future__ import annotations

import json
from pathlib import Path


# tokenizer_config.json classes that are transformers' plain Rust-backed tokenizer: loaded as
# that class directly, the same object AutoTokenizer builds, without AutoTokenizer's import of
# torch (the server's API process stays torch-free).
_PLAIN_FAST = {"PreTrainedTokenizerFast", "TokenizersBackend"}

# Words a BPE or Unigram model keeps the tokens of (`tokenizers`' default: 10,000). That cache
# keeps the first words it sees and never evicts, in the Rust heap (tracemalloc does not see it);
# an entry's size grows with its word (up to 256 characters), so a server's clients, sending
# numbers or random strings, fill it with words that never come again, and the process grows
# until it is full. A smaller cache keeps the common words, which is where it helps.
WORD_CACHE_WORDS = 1024


def load_tokenizer(path: str | Path):
    config = Path(path) / "tokenizer_config.json"
    try:
        if config.is_file() and json.loads(config.read_text()).get("tokenizer_class") in _PLAIN_FAST:
            from transformers import PreTrainedTokenizerFast

            return bound_word_cache(PreTrainedTokenizerFast.from_pretrained(str(path)))
        from transformers import AutoTokenizer  # importing it imports torch, when installed

        return bound_word_cache(AutoTokenizer.from_pretrained(str(path)))
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot load a tokenizer from {str(path)!r}: {e}") from e


def bound_word_cache(tokenizer, words: int = WORD_CACHE_WORDS):
    """Resize the Rust model's word cache (BPE, Unigram) to ``words``; other tokenizers as they are.
    The tokens a text encodes to do not depend on it."""
    model = getattr(getattr(tokenizer, "backend_tokenizer", None), "model", None)
    resize = getattr(model, "_resize_cache", None)  # tokenizers' own method; private, so probed
    if resize is not None:
        resize(words)
    return tokenizer


def eos_token_ids(model_dir: Path, hf_config, tokenizer) -> tuple[int, ...]:
    """Union of config.json's, generation_config.json's and the tokenizer's EOS ids."""
    ids: list[int] = []

    def add(value) -> None:
        if isinstance(value, int):
            ids.append(value)
        elif isinstance(value, (list, tuple)):
            ids.extend(v for v in value if isinstance(v, int))

    add(getattr(hf_config, "eos_token_id", None))
    gen = Path(model_dir) / "generation_config.json"
    if gen.is_file():
        add(json.loads(gen.read_text()).get("eos_token_id"))
    if tokenizer is not None:
        add(tokenizer.eos_token_id)
    return tuple(dict.fromkeys(ids))
