"""FP8 KV cache (--kv-cache-dtype fp8): twice the blocks in the same memory, and attention over
e4m3 k/v (with per-layer scales) in the Triton kernels equal to the torch reference."""

from __future__ import annotations

import logging

import pytest
import torch

from expresslane import LLM, SamplingParams
from expresslane.attention.torch_backend import TorchAttentionBackend
from expresslane.layers.rotary import RotaryEmbedding
from test_triton_attention import CASES, DEVICE, make_step

triton_backend = pytest.importorskip("expresslane.attention.triton_backend")


def test_fp8_kv_doubles_the_capacity_reported_at_start_up(llama_dir, caplog):
    """bfloat16 model, the same KV memory budget: an e4m3 cache holds twice the blocks."""
    blocks = {}
    for kv_dtype in ("auto", "fp8"):
        with caplog.at_level(logging.INFO, logger="expresslane.engine.core"):
            caplog.clear()
            llm = LLM(str(llama_dir), device="cpu", dtype="bfloat16", kv_cache_dtype=kv_dtype,
                      cpu_kv_cache_space_gb=1 / 256, max_model_len=512)
        blocks[kv_dtype] = llm.config.cache.num_kv_blocks
        line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache:"))
        assert line.startswith(f"KV cache: {blocks[kv_dtype]} blocks of 16 tokens (0.00 GiB")
        assert line.endswith("float8_e4m3fn)" if kv_dtype == "fp8" else "bfloat16)")
        assert llm.apply_model(lambda model: model.layers[0].self_attn.kv_cache.dtype) == [
            torch.float8_e4m3fn if kv_dtype == "fp8" else torch.bfloat16]
    assert blocks["fp8"] == 2 * blocks["auto"] > 0


def _fp8_copy(kv: torch.Tensor, scales) -> torch.Tensor:
    out = torch.empty(kv.shape, dtype=torch.float8_e4m3fn, device=kv.device)
    out[0] = (kv[0].float() / scales[0]).clamp(-448, 448).to(torch.float8_e4m3fn)
    out[1] = (kv[1].float() / scales[1]).clamp(-448, 448).to(torch.float8_e4m3fn)
    return out


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.5, 3.0)])
@pytest.mark.parametrize("rotary_part", [1.0, 0.75], ids=["whole", "partial"])  # partial: the rest copied
def test_triton_fp8_cache_matches_torch(case, scales, rotary_part):
    from expresslane.layers.rotary import RopeFrequencies, default_inv_freq

    heads, kv_heads, dim, bs, seqs = CASES[case]
    q, k, v, kv, meta, pos = make_step(seqs, heads, kv_heads, dim, bs, torch.float32, seed=20 + case)
    scale = dim ** -0.5
    kv_ref, kv_tri = _fp8_copy(kv, scales), _fp8_copy(kv, scales)
    freqs = RopeFrequencies("default", default_inv_freq(10000.0, int(dim * rotary_part)))
    rotary = RotaryEmbedding(dim, 512, freqs=freqs).to(q.device)
    torch_backend = TorchAttentionBackend()
    backend = triton_backend.TritonAttentionBackend(heads, kv_heads, dim, DEVICE)
    backend.prepare(meta)
    q_ref = torch_backend.store(pos, q, k, v, rotary, kv_ref, meta, scales)
    q_tri = backend.store(pos, q, k, v, rotary, kv_tri, meta, scales)
    # the same e4m3 values written: both rotate k in float32 and round k / k_scale to nearest.
    # Compared as values (a tiny negative may become +0 or -0). On a GPU the two rotations may
    # differ in the last float32 bit (fused multiply-adds), which can move a value that sits
    # on a rounding boundary by one e4m3 step (2^-3 relative, 2^-9 for subnormals): allowed, rarely.
    a, b = kv_tri.float(), kv_ref.float()
    diff = (a - b).abs()
    assert (diff <= torch.maximum(a.abs(), b.abs()) * 2**-3 + 2**-9).all()
    assert (diff > 0).float().mean() <= (0 if DEVICE.type == "cpu" else 1e-3)
    # attention over the same cache: float32 math, the kernel folding k_scale into the softmax
    # scale and v_scale into the output (a few float32 roundings apart)
    ref = torch_backend.attend(q_ref, kv_tri, meta, scale, scales)
    out = backend.attend(q_tri, kv_tri, meta, scale, scales)
    err = (out - ref).norm() / ref.norm()
    assert err < 1e-5, f"relative error {err:.2e}"


def test_fp8_kv_engine_greedy_equals_across_backends(llama_dir):
    """The whole engine with an FP8 cache: the Triton kernels (interpreter) and the torch
    reference produce the same greedy tokens, and stay close to the float cache's."""
    prompts = [[(13 * i + 7 * j) % 500 for j in range(n)] for i, n in enumerate((3, 20, 45))]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    got = {}
    for backend in ("torch", "triton"):
        llm = LLM(str(llama_dir), dtype="float32", kv_cache_dtype="fp8", attention_backend=backend, num_kv_blocks=64,
                  max_model_len=256, max_num_batched_tokens=32, max_num_seqs=4)
        got[backend] = [o.outputs[0].token_ids for o in llm.generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    assert got["torch"] == got["triton"]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_triton_fp8_cache_bf16_queries(case):
    """bf16 queries over an FP8 cache: the kernel's dots run in float16 (q converted exactly,
    the e4m3 values exact, p rounded to 2^-11); against float32 attention over the same cache,
    the bf16 output rounding (2^-8 relative) dominates."""
    if DEVICE.type == "cpu":
        pytest.skip("16-bit dot products are a GPU matter (the interpreter has no bfloat16)")
    heads, kv_heads, dim, bs, seqs = CASES[case]
    q, k, v, kv, meta, pos = make_step(seqs, heads, kv_heads, dim, bs, torch.float32, seed=40 + case)
    scales = (0.5, 3.0)
    kv8 = _fp8_copy(kv, scales)
    backend = triton_backend.TritonAttentionBackend(heads, kv_heads, dim, DEVICE)
    backend.prepare(meta)
    qb = q.to(torch.bfloat16)
    ref = TorchAttentionBackend().attend(qb.float(), kv8, meta, dim ** -0.5, scales)
    out = backend.attend(qb, kv8, meta, dim ** -0.5, scales).float()
    err = (out - ref).norm() / ref.norm()
    assert err < 4e-3, f"relative error {err:.2e}"
