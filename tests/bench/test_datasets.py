from __future__ import annotations

import json

import numpy as np
import pytest

from expresslane.bench.datasets import DatasetSpec, sample_requests


def test_random_lengths_follow_range_ratio():
    reqs = sample_requests(DatasetSpec("random", 200, 100, 50, range_ratio=0.2, seed=1))
    ins = [r.prompt_len for r in reqs]
    assert 80 <= min(ins) and max(ins) <= 120 and len(set(ins)) > 10
    assert all(40 <= r.output_len <= 60 for r in reqs)
    assert all(len(r.prompt.split()) == r.prompt_len for r in reqs)  # 1 token per word
    assert len({r.prompt for r in reqs}) == 200  # distinct: no accidental prefix hits


def test_tokens_per_word_scales_the_word_count():
    reqs = sample_requests(DatasetSpec("random", 5, 130, 8), tokens_per_word=1.3)
    assert all(len(r.prompt.split()) == 100 for r in reqs)
    assert all(r.prompt_len == 130 for r in reqs)


def test_same_seed_same_requests():
    spec = DatasetSpec("sharegpt-like", 50, seed=7)
    assert sample_requests(spec) == sample_requests(spec)
    assert sample_requests(spec) != sample_requests(DatasetSpec("sharegpt-like", 50, seed=8))


def test_sharegpt_like_is_skewed_around_the_median():
    reqs = sample_requests(DatasetSpec("sharegpt-like", 2000, 200, 100, seed=0))
    ins = np.array([r.prompt_len for r in reqs])
    assert np.median(ins) == pytest.approx(200, rel=0.15)
    assert ins.mean() > np.median(ins)  # long right tail
    assert ins.min() >= 4 and ins.max() <= 16 * 200


def test_mixed_has_the_long_fraction_and_classes():
    reqs = sample_requests(DatasetSpec("mixed", 100, 32, 8, long_fraction=0.2,
                                       long_input_len=2048, class_lanes=True))
    long = [r for r in reqs if r.length_class == "long"]
    assert len(long) == 20 and all(r.prompt_len == 2048 for r in long)
    assert all(r.lane == "batch" for r in long)
    assert {r.lane for r in reqs if r.length_class == "short"} == {"interactive"}
    assert [r.length_class for r in reqs[:20]].count("long") < 20  # shuffled


def test_jsonl_fields_and_errors(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "a b c", "output_len": 7, "lane": "batch",
                                "priority": 2}) + "\n\n" + json.dumps({"prompt": "d"}) + "\n")
    a, b = sample_requests(DatasetSpec(str(path), output_len=3))
    assert (a.prompt_len, a.output_len, a.lane, a.priority) == (3, 7, "batch", 2)
    assert (b.output_len, b.lane, b.priority) == (3, None, None)
    path.write_text('{"text": "no prompt"}\n')
    with pytest.raises(ValueError, match="'prompt'"):
        sample_requests(DatasetSpec(str(path)))
    with pytest.raises(ValueError, match="random, sharegpt-like, mixed"):
        sample_requests(DatasetSpec("nope"))
