"""The KV cache on the host is zero without a pass over it: an engine start on CPU does not
write (or commit) the whole default 4 GiB budget (it took 3-12 s of start-up on the 2-core
machine)."""

from __future__ import annotations

import pytest
import torch

from expresslane import LLM
from expresslane.device import kv_zeros

MiB = 1 << 20


def rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_a_host_kv_cache_is_zero_and_uncommitted(dtype):
    before = rss()
    cache = kv_zeros((2, 4096, 16, 8, 128), dtype, torch.device("cpu"))  # 256 MiB in float32
    assert rss() - before < 16 * MiB  # torch.zeros would have written (and committed) all of it
    assert cache.shape == (2, 4096, 16, 8, 128) and cache.dtype == dtype and cache.is_contiguous()
    assert not cache[0, 0].float().any() and not cache[1, 2048].float().any() and not cache[1, -1].float().any()
    cache[0, 7, 3] = 1.5  # an ordinary tensor: written where the engine writes
    assert cache[0, 7, 3].float().eq(1.5).all() and cache.float().sum().item() == 1.5 * 8 * 128


def test_an_engine_start_does_not_commit_its_cpu_kv_budget():
    before = rss()
    llm = LLM(device="cpu", cpu_kv_cache_space_gb=1.0)  # the built-in model: 256 x 2048 tokens would need 4.5 GiB
    [cache_bytes] = llm.apply_model(lambda model: sum(layer.self_attn.kv_cache.nbytes for layer in model.layers))
    assert cache_bytes > 900 * MiB
    assert rss() - before < cache_bytes / 4  # the model, its calibration steps: far less than the cache
    out = llm.generate(["hello"], use_tqdm=False)[0]  # and it serves
    assert out.outputs[0].token_ids
