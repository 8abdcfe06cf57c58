"""DeepSeek-V2 / V2-Lite / V3 (MLA over a latent KV cache, DeepSeek's MoE): greedy tokens equal
transformers' (float32, CPU) through chunked prefill, prefix-cache hits and preemptions, on the
torch and triton backends (interpreter), through the CUDA-graph input path, at TP=2 (gloo), with
expert parallelism and with speculation; the routers equal transformers'; what is refused, by name."""

import logging

import pytest
from models import MORE_ARCHS, build_model, hf_greedy
from test_equivalence import CASES, GREEDY, LENGTHS, MAX_TOKENS, PROMPTS

from expresslane import LLM, SamplingParams

DEEPSEEK = [arch for arch in MORE_ARCHS if arch.startswith("deepseek")]
# long prompts (chunked), the shared-prefix ones (hits), more tokens than 32 blocks of 16 hold (preemption)
PICKED = [0, 4, 8, 12] + list(range(len(LENGTHS), len(PROMPTS)))
SMALL = dict(max_num_batched_tokens=64, max_model_len=512, num_kv_blocks=32, enable_prefix_caching=True,
             scheduling_policy="fcfs")
# through the Triton kernels (Triton's interpreter on CPU: a program per token and head tile), fewer tokens:
# short prompts, three sharing a prefix (chunked, hits), more than 16 blocks of 16 hold (preemption)
KERNEL_PICKED = [0, 4] + list(range(len(LENGTHS), len(LENGTHS) + 3))
KERNEL_SMALL = dict(SMALL, max_model_len=256, num_kv_blocks=16)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek")
    return {arch: build_model(arch, root / arch) for arch in DEEPSEEK}


@pytest.fixture(scope="module")
def references(dirs):
    return {arch: [hf_greedy(d, p, MAX_TOKENS) for p in PROMPTS] for arch, d in dirs.items()}


def _check(llm: LLM, indices: list[int], reference: list[list[int]]) -> list:
    outs = llm.generate([{"prompt_token_ids": PROMPTS[i]} for i in indices], GREEDY, use_tqdm=False)
    mismatched = [i for i, o in zip(indices, outs) if o.outputs[0].token_ids != reference[i]]
    assert not mismatched, f"prompts {mismatched} differ from transformers"
    return outs


@pytest.mark.parametrize("arch", DEEPSEEK)
@pytest.mark.parametrize("case", list(CASES))
def test_greedy_matches_transformers(dirs, references, arch, case):
    llm = LLM(str(dirs[arch]), **CASES[case])
    outs = _check(llm, list(range(len(PROMPTS))), references[arch])
    core = llm.engine.core
    if CASES[case].get("scheduling_policy") == "fcfs" and CASES[case]["enable_prefix_caching"]:
        assert max(o.num_cached_tokens for o in outs[len(LENGTHS):]) >= 112, "shared prefixes should hit"
    if case == "preempt":
        assert core.scheduler.num_preemptions > 0, "the small KV cache should have forced preemptions"
    assert core.kv.num_held_blocks() == 0 and core.kv.pool.num_free == core.kv.pool.num_blocks


@pytest.mark.parametrize("arch", ["deepseek_v2"])  # V3 through the kernels: the graph input path below
def test_triton_backend_matches_transformers(dirs, references, arch):
    """The latent kernels, fused MoE and fused norms (Triton's interpreter): chunks, hits, preemption."""
    pytest.importorskip("triton")
    llm = LLM(str(dirs[arch]), attention_backend="triton", **KERNEL_SMALL)
    assert not llm.engine.runner.attn_backend.library  # (prefill_attention auto: MLA never takes cuDNN's path)
    _check(llm, KERNEL_PICKED, references[arch])
    assert llm.engine.core.scheduler.num_preemptions > 0
    assert llm.engine.core.kv.prefix_cache_hits > 0


def test_graph_input_path_matches_transformers(dirs, references, monkeypatch):
    """Steps through the CUDA graphs' static, padded buffers (run eagerly on CPU): padding tokens
    with slot -1 past the last seq, decodes inside mixed steps."""
    pytest.importorskip("triton")
    from expresslane.runner.model_runner import ModelRunner

    original = ModelRunner.build_graphs
    monkeypatch.setattr(ModelRunner, "build_graphs", lambda self, n, capture=True: original(self, n, capture=False))
    llm = LLM(str(dirs["deepseek_v3"]), attention_backend="triton", max_num_seqs=6, max_mixed_graph_tokens=64,
              **KERNEL_SMALL)
    assert llm.engine.runner.mixed_graphs is not None
    _check(llm, KERNEL_PICKED, references["deepseek_v3"])


def test_tensor_parallel_matches_transformers(dirs, references):
    """TP=2 over gloo: heads split, the latent cache and its projections replicated on each rank."""
    llm = LLM(str(dirs["deepseek_v2"]), tensor_parallel_size=2, **SMALL)
    try:
        _check(llm, PICKED, references["deepseek_v2"])
        assert llm.engine.core.scheduler.num_preemptions > 0
        held = llm.apply_model(lambda model: {n: p.numel() for n, p in model.named_parameters()})
    finally:
        llm.shutdown()
    for name in ("layers.0.self_attn.kv_b_proj.weight", "layers.0.self_attn.q_b_proj.weight",
                 "layers.0.self_attn.o_proj.weight"):
        assert held[0][name] == held[1][name] and held[0][name] * 2 == _full_numel(dirs["deepseek_v2"], name)
    for name in ("layers.0.self_attn.kv_a_proj_with_mqa.weight", "layers.0.self_attn.q_a_proj.weight"):
        assert held[0][name] == _full_numel(dirs["deepseek_v2"], name)


def test_expert_parallel_matches_transformers(dirs, references):
    """Whole experts a rank, tokens dispatched to them by all-to-all (gloo)."""
    llm = LLM(str(dirs["deepseek_v2"]), tensor_parallel_size=2, enable_expert_parallel=True, **SMALL)
    try:
        _check(llm, PICKED, references["deepseek_v2"])
    finally:
        llm.shutdown()


def test_speculation_matches_transformers(dirs):
    """Verify steps: a decoding seq's several query tokens (prompt-lookup proposals of a repeating text)."""
    prompts = [[5, 6, 7, 8, 9, 10, 11] * 6, [40, 41] * 25]
    want = [hf_greedy(dirs["deepseek_v2"], p, 16) for p in prompts]
    llm = LLM(str(dirs["deepseek_v2"]), speculative_method="ngram", num_speculative_tokens=3,
              speculative_disable_by_batch_size=64, max_model_len=256)
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert llm.engine.core.stats().spec_num_draft_tokens > 0


def _full_numel(model_dir, name: str) -> int:
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        shape = f.get_slice(f"model.{name}").get_shape()
    return shape[0] * shape[1]


def test_cache_holds_the_latent_and_start_up_reports_it(dirs, caplog):
    """A token costs kv_lora_rank + qk_rope_head_dim values a layer; the log gives both sizes."""
    with caplog.at_level(logging.INFO, logger="expresslane.runner.model_runner"):
        llm = LLM(str(dirs["deepseek_v2"]), num_kv_blocks=8, max_model_len=128)
    runner = llm.engine.runner
    cfg = llm.engine.core.hf_config
    latent = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    assert all(c.shape == (8, runner.block_size, latent) for c in runner.kv_caches)
    assert runner.kv_block_bytes() == latent * runner.block_size * cfg.num_hidden_layers * 4
    full = cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim)
    per_token = f"{latent * cfg.num_hidden_layers * 4} bytes per token"
    assert any(per_token in r.message and f"{full * cfg.num_hidden_layers * 4} bytes" in r.message
               for r in caplog.records)


@pytest.mark.parametrize("fields,match", [
    (dict(topk_method="sparsemixer"), "topk_method 'sparsemixer' is not supported"),
    (dict(topk_method="noaux_tc"), "topk_method 'noaux_tc' is not supported for deepseek_v2"),
    (dict(scoring_func="sigmoid"), "scoring_func 'sigmoid' is not supported for deepseek_v2"),
    (dict(norm_topk_prob=True), "norm_topk_prob true is not supported for deepseek_v2"),
    (dict(n_group=3), "n_group 3 must divide the 8 routed experts"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
    (dict(moe_layer_freq=2), "moe_layer_freq 2 is not supported"),
])
def test_unsupported_variants_are_refused(dirs, tmp_path, fields, match):
    import json
    import shutil

    d = shutil.copytree(dirs["deepseek_v2"], tmp_path / "m")
    (d / "config.json").write_text(json.dumps(json.loads((d / "config.json").read_text()) | fields))
    with pytest.raises(ValueError, match=match):
        LLM(str(d))


def test_fp8_kv_cache_lora_and_tp_not_dividing_heads_are_refused(dirs):
    with pytest.raises(ValueError, match="enable_lora is not supported for DeepseekV2ForCausalLM"):
        LLM(str(dirs["deepseek_v2"]), enable_lora=True)
    with pytest.raises(ValueError, match="kv_cache_dtype 'fp8' is not supported for DeepseekV2ForCausalLM"):
        LLM(str(dirs["deepseek_v2"]), kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="must divide the model's 4 attention heads"):
        LLM(str(dirs["deepseek_v2"]), tensor_parallel_size=3)


def test_multi_token_prediction_layers_are_skipped(dirs, references, tmp_path):
    """V3 checkpoints ship an MTP layer after the decoder's (model.layers.{num_hidden_layers}.*)."""
    import shutil

    import torch
    from safetensors.torch import save_file

    d = shutil.copytree(dirs["deepseek_v3"], tmp_path / "m")
    save_file({"model.layers.2.eh_proj.weight": torch.zeros(64, 128),
               "model.layers.2.self_attn.kv_b_proj.weight": torch.zeros(64, 32)}, str(d / "mtp.safetensors"))
    llm = LLM(str(d), max_model_len=512, num_kv_blocks=40)
    _check(llm, [0, 4, 8], references["deepseek_v3"])


@pytest.mark.parametrize("version,fields", [
    (2, dict(topk_method="greedy")),
    (2, dict(topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=16.0)),
    (3, dict(n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True)),
    (3, dict(n_group=8, topk_group=3, routed_scaling_factor=1.0, norm_topk_prob=False)),
])
def test_routing_equals_transformers_router(version, fields):
    """The chosen experts and their weights, token by token, exactly as transformers' own router."""
    import importlib

    import torch
    import transformers

    from expresslane.layers.deepseek_moe import route_deepseek, routing_of

    modeling = importlib.import_module(f"transformers.models.deepseek_v{version}.modeling_deepseek_v{version}")
    cfg = getattr(transformers, f"DeepseekV{version}Config")(hidden_size=32, n_routed_experts=16,
                                                             num_experts_per_tok=4, num_attention_heads=4, **fields)
    torch.manual_seed(0)
    router = getattr(modeling, f"DeepseekV{version}TopkRouter")(cfg)
    torch.nn.init.normal_(router.weight, std=0.5)
    bias = router.e_score_correction_bias.normal_(0.0, 0.1) if version == 3 else None
    x = torch.randn(64, 32)
    _, want_w, want_ids = router(x)
    weights, ids = route_deepseek(torch.nn.functional.linear(x, router.weight), 4, routing_of(cfg), bias)
    order, want_order = ids.argsort(-1), want_ids.argsort(-1)  # (both pick unsorted)
    assert torch.equal(ids.gather(1, order), want_ids.gather(1, want_order))
    assert torch.equal(weights.gather(1, order), want_w.gather(1, want_order))
