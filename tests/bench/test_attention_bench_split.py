"""attention_bench's cuDNN path for a chunk after cached keys (cuDNN has no bottom-right causal
mask): two calls, merged by their log-sum-exps, equal float32 causal attention. On CPU the
calls are torch's CPU flash op; the merge and the gather from the pages are the same code."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))

import attention_bench as ab  # noqa: E402


def test_split_by_lse_equals_causal_attention_over_the_pages():
    q, kv, meta, kvs = ab.paged([40], 150, torch.device("cpu"), torch.float32, seed=3)
    fn, how, error = ab.split_by_lse(q, kv, meta.block_tables[0], 150)
    assert error is None and "split" in how
    got = fn().squeeze(0).transpose(0, 1)  # [1, H, L, D] -> [L, H, D]
    assert ab.rel_err(got, ab.reference(q, *kvs[0])) < 1e-5
