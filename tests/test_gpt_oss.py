"""gpt-oss: greedy tokens equal transformers' GptOssForCausalLM (float32, eager attention) for a
tiny random model whose sliding window (24, the first of two layers) is smaller than most
prompts, through chunked prefill, prefix-cache hits and preemption, with the torch and triton
backends and tensor parallelism; the experts load from MXFP4 as shipped."""

import json
import shutil

import pytest
import torch
from models import build_model, hf_greedy, triton_through_graphs
from safetensors.torch import load_file, save_file
from test_equivalence import CASES, GREEDY, MAX_TOKENS, PROMPTS

from expresslane import LLM
from expresslane.models.registry import MODELS
from expresslane.quant.mxfp4 import BLOCK, Mxfp4Experts, dequantize_mxfp4, e2m1_values

WINDOW = 24


@pytest.fixture(scope="module")
def oss_dir(tmp_path_factory):
    return build_model("gpt_oss", tmp_path_factory.mktemp("gpt_oss") / "gpt_oss")


@pytest.fixture(scope="module")
def oss_refs(oss_dir):
    return [hf_greedy(oss_dir, p, MAX_TOKENS) for p in PROMPTS]


def test_reference_is_eager_with_sinks_and_alternating_windows(oss_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(oss_dir, dtype=torch.float32)
    assert hf.config._attn_implementation == "eager"
    assert hf.config.layer_types == ["sliding_attention", "full_attention"] and hf.config.sliding_window == WINDOW
    assert MODELS["GptOssForCausalLM"].attention_windows(hf.config) == [WINDOW, None]
    assert hf.model.layers[0].self_attn.sinks.abs().max() > 0.5  # sinks that take a share of the attention


@pytest.mark.parametrize("case", ["chunk16-cache", "preempt", "small-cache"])
def test_greedy_matches_transformers(oss_dir, oss_refs, case):
    """Every prompt of the equivalence suite (most longer than the window, all running on past
    it while decoding) through chunks, prefix hits and preemption. Its two layers are two KV groups:
    a block holds one layer's K and V, so the same memory is twice the blocks."""
    config = dict(CASES[case])
    if "num_kv_blocks" in config:
        config["num_kv_blocks"] *= 2
    llm = LLM(str(oss_dir), **config)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    mismatched = [i for i, o in enumerate(outs) if o.outputs[0].token_ids != oss_refs[i]]
    assert not mismatched, f"prompts {mismatched} differ from transformers"
    core = llm.engine.core
    if CASES[case].get("scheduling_policy") == "fcfs":
        assert max(o.num_cached_tokens for o in outs) >= 112
    if case == "preempt":
        assert core.scheduler.num_preemptions > 0
    assert core.kv.num_held_blocks() == 0 and core.kv.pool.num_free == core.kv.pool.num_blocks


def test_triton_backend_matches_transformers(oss_dir, oss_refs):
    """The kernels (sinks, the window on one layer, the fused MoE with biases and the clamped
    SwiGLU; the interpreter on CPU) through the CUDA-graph input path, with chunks, prefix
    hits and preemption."""
    pytest.importorskip("triton")
    llm = triton_through_graphs(oss_dir, PROMPTS, oss_refs, num_kv_blocks=48)  # (two KV groups)
    assert llm.engine.runner.model.layers[0].mlp.fused


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_tensor_parallel_matches_transformers(oss_dir, oss_refs, expert_parallel):
    """TP=2 over gloo: each rank holds its heads' sinks and a slice of every expert (the down
    bias added by one rank), or with expert parallelism whole experts with their biases."""
    from test_tensor_parallel import CASE, PICKED

    llm = LLM(str(oss_dir), tensor_parallel_size=2, enable_expert_parallel=expert_parallel,
              **{**CASE, "num_kv_blocks": 2 * CASE["num_kv_blocks"]})  # (two KV groups)
    try:
        outs = llm.generate([{"prompt_token_ids": PROMPTS[i]} for i in PICKED], GREEDY, use_tqdm=False)
        assert llm.engine.core.scheduler.num_preemptions > 0
    finally:
        llm.shutdown()
    mismatched = [i for i, o in zip(PICKED, outs) if o.outputs[0].token_ids != oss_refs[i]]
    assert not mismatched, f"prompts {mismatched} differ from transformers"


# -- MXFP4 experts as shipped ------------------------------------------------------------------
def pack_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., N, K] float -> (blocks uint8 [..., N, K / 32, 16], scales uint8 [..., N, K / 32]): each
    block of 32 scaled by a power of two that brings its largest value within 6, every value
    rounded to the nearest e2m1 code."""
    blocks = w.float().unflatten(-1, (-1, BLOCK))
    amax = blocks.abs().amax(-1).clamp(min=2.0 ** -120)
    exp = torch.ceil(torch.log2(amax / 6.0))
    table = e2m1_values()
    codes = ((blocks / torch.exp2(exp)[..., None])[..., None] - table).abs().argmin(-1)  # ties: +0 before -0
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return packed, (exp + 127).to(torch.uint8)


def test_dequantize_mxfp4_values():
    table = e2m1_values()
    assert table.tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
    blocks = torch.zeros(1, 1, 16, dtype=torch.uint8)
    blocks[0, 0, 0] = 0x71  # element 0: code 1 (0.5), element 1: code 7 (6)
    blocks[0, 0, 15] = 0xA0  # element 30: 0, element 31: code 10 (-1)
    out = dequantize_mxfp4(blocks, torch.full((1, 1), 129, dtype=torch.uint8), torch.float32)
    assert out.shape == (1, 32) and out[0, :2].tolist() == [2.0, 24.0] and out[0, 30:].tolist() == [0.0, -4.0]
    with pytest.raises(ValueError, match="do not fit"):
        dequantize_mxfp4(blocks, torch.zeros(1, 2, dtype=torch.uint8), torch.float32)


def _mxfp4_checkpoint(src, packed_dir, float_dir):
    """The float checkpoint `src` with its experts packed to MXFP4 as gpt-oss ships them
    (`packed_dir`), and with the same experts dequantized back to float (`float_dir`)."""
    tensors = load_file(src / "model.safetensors")
    packed, dequantized = {}, {}
    for name, t in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = pack_mxfp4(t.transpose(1, 2))  # input-major -> output-major
            packed[f"{name}_blocks"], packed[f"{name}_scales"] = blocks, scales
            dequantized[name] = dequantize_mxfp4(blocks, scales, torch.float32).transpose(1, 2).contiguous()
        else:
            packed[name] = dequantized[name] = t
    for out, weights in ((packed_dir, packed), (float_dir, dequantized)):
        shutil.copytree(src, out)
        save_file(weights, out / "model.safetensors")
    config = json.loads((packed_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (packed_dir / "config.json").write_text(json.dumps(config))
    return tensors


@pytest.mark.parametrize("backend", ["torch", "triton", "torch-tp2"])
def test_mxfp4_experts_load_as_shipped(oss_dir, tmp_path, backend):
    """A checkpoint whose experts are packed to MXFP4 loads them packed (gate and up rows
    de-interleaved), equal to their dequantized values, and runs greedy as transformers runs
    the dequantized float checkpoint: the torch path dequantizing an expert at a time, the
    fused GEMMs decoding MXFP4 in the kernel (the interpreter on CPU), and over two
    tensor-parallel ranks (each with its 32-blocks of every expert's intermediate size)."""
    if backend == "triton":
        pytest.importorskip("triton")
    packed_dir, float_dir = tmp_path / "mxfp4", tmp_path / "float"
    tensors = _mxfp4_checkpoint(oss_dir, packed_dir, float_dir)
    if backend == "torch-tp2":
        llm = LLM(str(packed_dir), tensor_parallel_size=2, max_num_batched_tokens=32)
        try:
            outs = llm.generate([{"prompt_token_ids": PROMPTS[i]} for i in (2, 12, 17)], GREEDY, use_tqdm=False)
        finally:
            llm.shutdown()
        assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(float_dir, PROMPTS[i], MAX_TOKENS)
                                                          for i in (2, 12, 17)]
        return
    llm = LLM(str(packed_dir), attention_backend=backend, max_num_batched_tokens=32, enable_prefix_caching=True)
    moe = llm.engine.runner.model.layers[1].mlp
    assert isinstance(moe.w13, Mxfp4Experts) and moe.w13.blocks.dtype == torch.uint8
    experts = moe.w13.shape[0]
    expected = load_file(float_dir / "model.safetensors")
    gate_up = expected["model.layers.1.mlp.experts.gate_up_proj"].transpose(1, 2)  # [E, 2I, H], interleaved
    w13 = torch.stack([moe.w13[e] for e in range(experts)])
    w2 = torch.stack([moe.w2[e] for e in range(experts)])
    assert torch.equal(w13, torch.cat([gate_up[:, 0::2], gate_up[:, 1::2]], dim=1))
    assert torch.equal(w2, expected["model.layers.1.mlp.experts.down_proj"].transpose(1, 2))
    assert not torch.equal(w2, tensors["model.layers.1.mlp.experts.down_proj"].transpose(1, 2))  # lossy
    # short, chunked and long prompts; the interpreter (triton) takes a short and a long (chunked) one
    # only: the 100-token prompt and the shared-prefix pair (16, 17) run no other expert kernel path
    picked = [2, 12] if backend == "triton" else [2, 8, 12, 16, 17]
    outs = llm.generate([{"prompt_token_ids": PROMPTS[i]} for i in picked], GREEDY, use_tqdm=False)
    mismatched = [i for i, o in zip(picked, outs) if o.outputs[0].token_ids != hf_greedy(float_dir, PROMPTS[i],
                                                                                          MAX_TOKENS)]
    assert not mismatched, f"prompts {mismatched} differ from transformers on the dequantized checkpoint"


def test_mxfp4_half_missing_is_refused(oss_dir, tmp_path):
    packed_dir = tmp_path / "mxfp4"
    _mxfp4_checkpoint(oss_dir, packed_dir, tmp_path / "float")
    tensors = load_file(packed_dir / "model.safetensors")
    del tensors["model.layers.0.mlp.experts.down_proj_scales"]
    save_file(tensors, packed_dir / "model.safetensors")
    with pytest.raises(ValueError, match="checkpoint is missing"):
        LLM(str(packed_dir))
