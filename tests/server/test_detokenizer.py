"""DecodeStream detokenization gives exactly the text of the Python incremental detokenizer."""

from __future__ import annotations

import random

from expresslane.engine.detokenizer import IncrementalDetokenizer


def texts(tokenizer, prompt: list[int], tokens: list[int], chunks: list[int], skip: bool) -> tuple[str, str, bool]:
    fast = IncrementalDetokenizer(tokenizer, prompt, None, skip)
    slow = IncrementalDetokenizer(tokenizer, prompt, None, skip)
    slow._stream = None  # the Python version
    at = 0
    for n in chunks:  # tokens arrive a few at a time, as steps deliver them
        fast.add(tokens[at:at + n])
        slow.add(tokens[at:at + n])
        at += n
    return fast.text, slow.text, fast._stream is not None


def test_decode_stream_text_equals_the_python_version(llm):
    tok = llm.tokenizer
    rng = random.Random(0)
    vocab = len(tok)
    used = 0
    samples = ["Hello, world! ", "naïve café — 東京 🚀 ", "  spaces\n\nand\ttabs ", "<|im_start|>x<|im_end|>"]
    for i in range(300):
        prompt = tok.encode(rng.choice(samples) * rng.randint(1, 2))
        if i % 2:  # random ids: partial UTF-8 sequences, special tokens, odd merges
            tokens = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        else:
            tokens = tok.encode(rng.choice(samples) * 3, add_special_tokens=False)
        chunks = [rng.randint(1, 3) for _ in tokens]
        fast, slow, streamed = texts(tok, prompt, tokens, chunks, skip=bool(i % 3))
        assert fast == slow, (prompt, tokens)
        used += streamed
    assert used > 250  # the DecodeStream path is what ran
