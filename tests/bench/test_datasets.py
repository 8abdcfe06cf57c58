"""Dataset shapes, context fitting, and fresh prompts of exact lengths."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from expresslane.bench.datasets import DatasetSpec, Shape, draw_prompts, fit_context, sample_shapes
from expresslane.bench.prompts import LocalTokenizer, PromptMaker
from expresslane.models.presets import default_model_dir


def draw(shapes, maker=None, salt=0, seed=0, prefix_len=0):
    return asyncio.run(draw_prompts(shapes, maker or PromptMaker(None), seed, salt, prefix_len))


@pytest.fixture(scope="module")
def tiny_tokenizer():
    """The built-in model's real tokenizer (byte-level BPE, ~2.7 tokens a word, adds BOS)."""
    maker = PromptMaker(LocalTokenizer(str(default_model_dir())))
    asyncio.run(maker.calibrate())
    return maker


def test_random_lengths_follow_range_ratio():
    shapes = sample_shapes(DatasetSpec("random", 200, 100, 50, range_ratio=0.2, seed=1))
    ins = [s.input_len for s in shapes]
    assert 80 <= min(ins) and max(ins) <= 120 and len(set(ins)) > 10
    assert all(40 <= s.output_len <= 60 for s in shapes)
    reqs = draw(shapes)
    assert all(len(r.prompt.split()) == r.prompt_len == s.input_len for r, s in zip(reqs, shapes))
    assert len({tuple(r.prompt.split()[:8]) for r in reqs}) == 200  # no shared first block


def test_every_use_draws_fresh_prompts_of_the_same_shapes():
    shapes = sample_shapes(DatasetSpec("random", 20, 64, 4, seed=3))
    a, b, again = draw(shapes, salt=0), draw(shapes, salt=1), draw(shapes, salt=0)
    assert [r.prompt for r in a] == [r.prompt for r in again]  # deterministic
    assert not {r.prompt for r in a} & {r.prompt for r in b}  # a sweep point, warm-up, probe: new text
    assert [r.prompt_len for r in a] == [r.prompt_len for r in b]


def test_exact_lengths_with_the_model_tokenizer(tiny_tokenizer):
    shapes = [Shape(n, 4) for n in (1, 2, 7, 16, 100, 333, 1000)]
    reqs = draw(shapes, tiny_tokenizer)
    tok = tiny_tokenizer.tokenizer.tok
    for r, s in zip(reqs, shapes):  # the count the server will make: BOS included
        assert len(tok.encode(r.prompt)) == r.prompt_len == max(s.input_len, 2), s
    assert tiny_tokenizer.specials == 1 and tiny_tokenizer.tokens_per_word > 1.5


def test_prefix_repetition_shares_prefixes_on_purpose(tiny_tokenizer):
    spec = DatasetSpec("prefix-repetition", 12, 200, 4, prefix_len=64, num_prefixes=3, seed=5)
    shapes = sample_shapes(spec)
    assert [s.prefix for s in shapes] == [0, 1, 2] * 4
    reqs = draw(shapes, tiny_tokenizer, prefix_len=64)
    tok = tiny_tokenizer.tokenizer.tok
    ids = [tok.encode(r.prompt) for r in reqs]
    assert all(len(i) == 200 for i in ids)
    for k in range(3):  # prompts of one prefix share its 64 tokens, and then differ
        group = [ids[i] for i in range(k, 12, 3)]
        assert all(g[:64] == group[0][:64] for g in group)  # BOS + 63
        assert len({tuple(g[64:80]) for g in group}) == 4
    assert ids[0][1:17] != ids[1][1:17]  # different prefixes
    later = draw(shapes, tiny_tokenizer, salt=1, prefix_len=64)
    assert later[0].prompt.split()[:10] == reqs[0].prompt.split()[:10]  # same prefixes every use
    with pytest.raises(ValueError, match="prefix_len"):
        sample_shapes(DatasetSpec("prefix-repetition", 4, 32, 4, prefix_len=64))


def test_fit_context_caps_synthetic_and_skips_file_prompts():
    shapes = [Shape(100, 10), Shape(3000, 10, "long"), Shape(50, 10, text="a b"),
              Shape(5000, 10, text="long file prompt")]
    kept, notices = fit_context(shapes, 2048, overhead=5)
    assert [s.input_len for s in kept] == [100, 2048 - 10 - 5, 50]
    assert kept[1].length_class == "long"
    assert any("1 of 4 prompts" in n and "capped" in n for n in notices)
    assert any("1 of 4 prompts" in n and "skipped" in n for n in notices)
    same, said = fit_context(shapes, None)
    assert same == shapes and "did not report its context length" in said[0]
    with pytest.raises(ValueError, match="no prompt fits"):
        fit_context([Shape(10, 5000)], 2048)


def test_same_seed_same_shapes():
    spec = DatasetSpec("sharegpt-like", 50, seed=7)
    assert sample_shapes(spec) == sample_shapes(spec)
    assert sample_shapes(spec) != sample_shapes(DatasetSpec("sharegpt-like", 50, seed=8))


def test_sharegpt_like_is_skewed_around_the_median():
    shapes = sample_shapes(DatasetSpec("sharegpt-like", 2000, 200, 100, seed=0))
    ins = np.array([s.input_len for s in shapes])
    assert np.median(ins) == pytest.approx(200, rel=0.15)
    assert ins.mean() > np.median(ins)  # long right tail
    assert ins.min() >= 4 and ins.max() <= 16 * 200


def test_mixed_has_the_long_fraction_and_classes():
    shapes = sample_shapes(DatasetSpec("mixed", 100, 32, 8, long_fraction=0.2,
                                       long_input_len=2048, class_lanes=True))
    long = [s for s in shapes if s.length_class == "long"]
    assert len(long) == 20 and all(s.input_len == 2048 for s in long)
    assert all(s.lane == "batch" for s in long)
    assert {s.lane for s in shapes if s.length_class == "short"} == {"interactive"}
    assert [s.length_class for s in shapes[:20]].count("long") < 20  # shuffled


def test_jsonl_fields_and_errors(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "a b c", "output_len": 7, "lane": "batch",
                                "priority": 2}) + "\n\n" + json.dumps({"prompt": "d"}) + "\n")
    a, b = sample_shapes(DatasetSpec(str(path), output_len=3))
    assert (a.text, a.input_len, a.output_len, a.lane, a.priority) == ("a b c", 3, 7, "batch", 2)
    assert (b.output_len, b.lane, b.priority) == (3, None, None)
    path.write_text('{"text": "no prompt"}\n')
    with pytest.raises(ValueError, match="'prompt'"):
        sample_shapes(DatasetSpec(str(path)))
    with pytest.raises(ValueError, match="random, sharegpt-like, mixed, prefix-repetition"):
        sample_shapes(DatasetSpec("nope"))
