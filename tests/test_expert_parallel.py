"""Expert parallelism on CPU (gloo, float32): with enable_expert_parallel each of the 2 ranks
holds whole experts (odd counts: ceil(E/2) on rank 0, the rest on rank 1) and tokens reach
them by all-to-all; greedy tokens equal one process's, through chunked prefill, prefix-cache
hits and preemptions."""

import pytest
from test_tensor_parallel import CASE, PICKED, _generate, weight_numel

from expresslane import LLM


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_ep2_matches_ep1(model_dirs, arch):
    one = LLM(str(model_dirs[arch]), **CASE)
    expected = _generate(one)
    [full] = one.apply_model(lambda model: {name: p.shape for name, p in model.named_parameters()})
    llm = LLM(str(model_dirs[arch]), tensor_parallel_size=2, enable_expert_parallel=True, **CASE)
    try:
        got = _generate(llm)
        per_rank = weight_numel(llm)
        core = llm.engine.core
        assert core.scheduler.num_preemptions > 0 and core.kv.prefix_cache_hits > 0
    finally:
        llm.shutdown()
    mismatched = [PICKED[i] for i, (g, r) in enumerate(zip(got, expected)) if g != r]
    assert not mismatched, f"EP=2: prompts {mismatched} differ from EP=1"
    stacked = [n for n in full if n.endswith(("mlp.w13", "mlp.w2"))]
    assert stacked
    for name in stacked:  # whole experts (every row), split by expert
        experts, per_expert = full[name][0], full[name][1:].numel()
        held = [per_rank[r][name] for r in (0, 1)]
        assert held == [-(-experts // 2) * per_expert, experts // 2 * per_expert], name


def test_ep_refuses_a_rank_without_experts(model_dirs):
    with pytest.raises(ValueError, match="leaves a rank without experts"):
        LLM(str(model_dirs["mixtral"]), tensor_parallel_size=4, enable_expert_parallel=True, **CASE)

