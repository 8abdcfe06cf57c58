"""InputProcessor encodes with the Rust tokenizer directly: the same ids as transformers'
`encode`, for every test model's tokenizer and awkward text."""

import numpy as np

from expresslane.bench.prompts import word_text
from expresslane.engine.inputs import InputProcessor
from expresslane.tokenizer import load_tokenizer

TEXTS = ["hello", "", " ", "  spaced  out \n\n tabs\t", "<|im_start|>user\nhi<|im_end|>\n",
         "<|begin_of_text|>twice<|begin_of_text|>", "é ü 中文 🙂 \ufffd", "a" * 5000]


def test_direct_encode_gives_transformers_ids(model_dirs):
    for path in model_dirs.values():
        tok = load_tokenizer(path)
        inputs = InputProcessor(tok, tok.vocab_size, 1 << 20, (0,))
        assert inputs.encode is not tok.encode  # the Rust path is taken
        for text in TEXTS + [word_text(np.random.default_rng(0), 4000)]:
            assert inputs.tokenize(text)[1] == tok.encode(text), (path.name, text[:40])
            assert inputs.tokenize({"prompt": text})[1] == tok.encode(text)


def test_a_tokenizer_without_a_rust_backend_uses_its_own_encode():
    class Words:
        def encode(self, text):
            return [len(w) for w in text.split()]

    inputs = InputProcessor(Words(), 100, 1 << 20, (0,))
    assert inputs.tokenize("ab cde f") == ("ab cde f", [2, 3, 1])
