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


def test_truncate_keeps_the_last_tokens_within_the_context():
    """vLLM's truncate_prompt_tokens: the last k tokens (a cut prompt loses its text), -1 the
    context's worth, more than the context refused by name; None or a short prompt unchanged."""
    from types import SimpleNamespace

    import pytest

    from expresslane.engine.inputs import InputError

    inputs = InputProcessor(SimpleNamespace(encode=lambda text: []), 100, 8, ())
    ids = list(range(12))
    assert inputs.truncate("t", ids, None) == ("t", ids)
    assert inputs.truncate("t", ids, 3) == (None, [9, 10, 11])
    assert inputs.truncate("t", ids, -1) == (None, ids[-8:])
    assert inputs.truncate("t", ids[:2], 3) == ("t", ids[:2])
    with pytest.raises(InputError) as e:
        inputs.truncate("t", ids, 9)
    assert e.value.param == "truncate_prompt_tokens"


def test_generate_with_truncate_prompt_tokens_equals_the_cut_prompt(llama_dir):
    """SamplingParams.truncate_prompt_tokens (vLLM's): the output of the prompt's last k tokens alone."""
    from expresslane import LLM, SamplingParams

    llm = LLM(str(llama_dir))
    ids = list(range(5, 40))
    greedy = dict(max_tokens=5, temperature=0.0, ignore_eos=True)
    [cut] = llm.generate([{"prompt_token_ids": ids}], SamplingParams(truncate_prompt_tokens=9, **greedy),
                         use_tqdm=False)
    [alone] = llm.generate([{"prompt_token_ids": ids[-9:]}], SamplingParams(**greedy), use_tqdm=False)
    assert cut.prompt_token_ids == ids[-9:] and cut.outputs[0].token_ids == alone.outputs[0].token_ids
