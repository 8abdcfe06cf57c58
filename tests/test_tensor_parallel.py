"""Tensor parallelism on CPU (gloo, float32): greedy tokens of TP=2 equal TP=1's on every
architecture, and TP=4's on the ones whose split differs at 4 ranks, through chunked prefill,
prefix-cache hits and preemptions; each rank holds 1/N of every sharded weight (measured on
every rank)."""

import pytest
from models import ARCHS
from test_equivalence import GREEDY, LENGTHS, PROMPTS

from expresslane import LLM, SamplingParams

# long prompts (chunked at 64 tokens), the shared-prefix ones (prefix hits), and more tokens
# than the 32 blocks x 16 of KV cache hold at once (preemption). fcfs: the same steps whatever
# the machine's speed (the default deadline policy sizes steps by a cost model timed at start-up,
# so a slower TP engine ran other steps: no preemption, other chunks)
PICKED = [0, 4, 8, 12] + list(range(len(LENGTHS), len(PROMPTS)))
CASE = dict(max_num_batched_tokens=64, max_model_len=512, num_kv_blocks=32, enable_prefix_caching=True,
            scheduling_policy="fcfs")
REPLICATED = ("layernorm.weight", "norm.weight", "q_norm.weight", "k_norm.weight", "mlp.gate.weight")  # + MoE routers


def _generate(llm: LLM) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": PROMPTS[i]} for i in PICKED], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def weight_numel(llm: LLM) -> list[dict[str, int]]:
    """Per rank: parameter name -> elements it holds."""
    return llm.apply_model(lambda model: {name: p.numel() for name, p in model.named_parameters()})


@pytest.fixture(scope="module")
def tp1(model_dirs):
    out = {}
    for arch, d in model_dirs.items():
        llm = LLM(str(d), **CASE)
        out[arch] = (_generate(llm), weight_numel(llm)[0], llm.engine.core.hf_config)
    return out


def _expected_numel(name: str, full: int, cfg, tp: int) -> int:
    if name.endswith(REPLICATED):
        return full
    if "qkv_proj" in name:  # q heads split; KV heads split, or one kept per rank when fewer than ranks
        heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
        rows_full = heads + 2 * kv
        return full // rows_full * (heads // tp + 2 * max(kv // tp, 1))
    return full // tp


# TP=4 (four processes on CI's two cores: the costliest cases) where four ranks split otherwise than two:
# fewer KV heads than ranks (each rank keeps one of the two) and each expert's intermediate size in
# quarters, both in qwen3_moe (the dense families split at 2 as at 4: llama's llama3 RoPE, qwen2's biases)
TP4 = ("qwen3_moe",)


@pytest.mark.parametrize("arch,tp", [(arch, 2) for arch in ARCHS] + [(arch, 4) for arch in TP4])
def test_tp_matches_tp1(model_dirs, tp1, arch, tp):
    tokens, numel, cfg = tp1[arch]
    llm = LLM(str(model_dirs[arch]), tensor_parallel_size=tp, **CASE)
    try:
        got = _generate(llm)
        per_rank = weight_numel(llm)
        core = llm.engine.core
        assert core.scheduler.num_preemptions > 0, "the small KV cache should have forced preemptions"
        assert core.kv.prefix_cache_hits > 0
    finally:
        llm.shutdown()
    mismatched = [PICKED[i] for i, (g, r) in enumerate(zip(got, tokens)) if g != r]
    assert not mismatched, f"TP={tp}: prompts {mismatched} differ from TP=1"
    assert len(per_rank) == tp
    for rank, held in enumerate(per_rank):
        assert held.keys() == numel.keys()
        wrong = {n: (held[n], numel[n]) for n in numel if held[n] != _expected_numel(n, numel[n], cfg, tp)}
        assert not wrong, f"rank {rank} holds the wrong share of {wrong}"
    sharded = [n for n in numel if not n.endswith(REPLICATED) and "qkv_proj" not in n]
    assert sum(per_rank[-1][n] for n in sharded) * tp == sum(numel[n] for n in sharded)


def test_tp_refuses_bad_sizes(model_dirs):
    with pytest.raises(ValueError, match="must divide the model's 4 attention heads"):
        LLM(str(model_dirs["llama"]), tensor_parallel_size=3)
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        LLM(str(model_dirs["llama"]), tensor_parallel_size=0)
    with pytest.raises(ValueError, match="dist_init_addr"):
        LLM(str(model_dirs["llama"]), tensor_parallel_size=2, nnodes=2)


def test_tp_engine_failing_at_start_stops_its_workers(model_dirs):
    """A TP=2 engine whose start fails after its workers joined (too small a KV cache) stops them and
    leaves the process group: the next TP engine in the process starts and runs."""
    import torch.distributed as dist

    with pytest.raises(ValueError, match="KV cache has 2 blocks"):
        LLM(str(model_dirs["llama"]), tensor_parallel_size=2, num_kv_blocks=2, max_model_len=64)
    assert not dist.is_initialized()
    llm = LLM(str(model_dirs["llama"]), tensor_parallel_size=2, max_model_len=64)
    try:
        out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(temperature=0, max_tokens=2),
                           use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 2
    finally:
        llm.shutdown()
