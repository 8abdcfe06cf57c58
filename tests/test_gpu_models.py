"""Issue #43's and #41's model capabilities on CUDA (Triton kernels, captured graphs): greedy tokens
equal transformers' for the families and RoPE types added; sliding windows smaller than the prompt;
LoRA adapters and embeddings on CUDA equal the same engine on CPU (which CI checks against peft and
transformers)."""

import json
from pathlib import Path

import pytest
import torch
from models import build_model, hf_greedy

from expresslane import LLM, LoRARequest, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPTS = [[(7 * i + 3 * j) % 500 for j in range(n)] for i, n in enumerate((1, 17, 64, 150, 300, 33))]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def cuda_llm(model_dir, **kw) -> LLM:
    torch.backends.cuda.matmul.allow_tf32 = False
    return LLM(str(model_dir), device="cuda", dtype="float32", num_kv_blocks=256, **kw)


def tokens(llm: LLM, prompts, **kw) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False, **kw)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "phi3", "llama_linear", "llama_dynamic", "qwen2_yarn"])
def test_new_families_match_transformers_on_cuda(model_dirs, arch):
    llm = cuda_llm(model_dirs[arch], max_num_batched_tokens=64)
    assert llm.cuda_graph_sizes["decode"]
    got = tokens(llm, PROMPTS)
    mismatched = [i for i, p in enumerate(PROMPTS) if got[i] != hf_greedy(model_dirs[arch], p, 8)]
    assert not mismatched, f"prompts {mismatched} differ from transformers"


@pytest.mark.parametrize("arch,window", [("mistral", 48), ("ministral", 24), ("gemma3", 24)])
def test_sliding_window_smaller_than_the_prompt_on_cuda(tmp_path, arch, window):
    """Every layer windowed (mistral), or one of two (ministral, gemma3: two KV groups, each
    layer's own block tables in the captured graphs): blocks behind a window are freed as the
    requests run."""
    model_dir = build_model(arch, tmp_path / arch, sliding_window=window)
    llm = cuda_llm(model_dir, max_num_batched_tokens=64)
    assert llm.cuda_graph_sizes["decode"]
    got = tokens(llm, PROMPTS)
    mismatched = [i for i, p in enumerate(PROMPTS) if got[i] != hf_greedy(model_dir, p, 8)]
    assert not mismatched, f"prompts {mismatched} differ from transformers"
    assert llm.engine.core.kv.window_freed_blocks > 0


def write_adapter(model_dir: Path, out: Path, rank: int, seed: int) -> Path:
    from safetensors.torch import save_file

    cfg = json.loads((model_dir / "config.json").read_text())
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    d = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    shapes = {"self_attn.q_proj": (h, q), "self_attn.k_proj": (h, kv), "self_attn.v_proj": (h, kv),
              "self_attn.o_proj": (q, h), "mlp.gate_proj": (h, inter), "mlp.up_proj": (h, inter),
              "mlp.down_proj": (inter, h)}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for name, (fan_in, fan_out) in shapes.items():
            prefix = f"base_model.model.model.layers.{layer}.{name}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * 0.1
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.1
    out.mkdir(parents=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank}))
    return out


def scored(llm: LLM, sequences, loras) -> list[list[float]]:
    """Each sequence's prompt logprobs (teacher-forced): the logprob of every next token."""
    outs = llm.generate([{"prompt_token_ids": s} for s in sequences], SamplingParams(
        temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False, lora_request=loras)
    return [[lp[tok].logprob for lp, tok in zip(o.prompt_logprobs[1:], s[1:])] for o, s in zip(outs, sequences)]


def test_lora_on_cuda_equals_cpu(llama_dir, tmp_path):
    """A batch mixing the base model and three adapters of different ranks, two slots, through the
    Triton shrink/expand and captured graphs: the CPU engine's logprobs along the CPU's greedy
    continuations (teacher-forced: float32 sums in another order flip near-ties of the random model)."""
    loras = [LoRARequest(f"r{r}", i, str(write_adapter(llama_dir, tmp_path / f"r{r}", r, i)))
             for i, r in enumerate((4, 8, 16), 1)]
    jobs = [(lora, p) for p in PROMPTS[:4] for lora in [None] + loras]
    adapters = [lora for lora, _ in jobs]
    kw = dict(enable_lora=True, max_loras=2, max_lora_rank=16, max_num_batched_tokens=64)
    cpu = LLM(str(llama_dir), num_kv_blocks=256, **kw)
    sequences = [p + t for (_, p), t in zip(jobs, tokens(cpu, [p for _, p in jobs], lora_request=adapters))]
    want = scored(cpu, sequences, adapters)
    llm = cuda_llm(llama_dir, **kw)
    assert llm.cuda_graph_sizes["decode"]
    got = scored(llm, sequences, adapters)
    for job, g, w in zip(jobs, got, want):
        torch.testing.assert_close(torch.tensor(g), torch.tensor(w), atol=1e-3, rtol=0, msg=lambda m: f"{job}: {m}")
    assert len({tuple(w[-8:]) for w, (_, p) in zip(want, jobs) if p == PROMPTS[3]}) > 1, "the adapters change nothing"


def test_lora_batch1_decode_on_cuda_equals_cpu(llama_dir, tmp_path, monkeypatch):
    """A lone request's decode steps: one token, the base GEMV with the adapter inline (`lora_gemv`)
    in the captured batch-1 graph; tokens and their logprobs equal the CPU engine's."""
    from expresslane.layers import lora_kernels

    lora = LoRARequest("r16", 1, str(write_adapter(llama_dir, tmp_path / "r16", 16, 1)))
    kw = dict(enable_lora=True, max_loras=1, max_lora_rank=16, max_num_batched_tokens=64)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    calls, gemv = [], lora_kernels.lora_gemv
    monkeypatch.setattr(lora_kernels, "lora_gemv", lambda *a, **k: calls.append(1) or gemv(*a, **k))
    cpu, llm = LLM(str(llama_dir), num_kv_blocks=256, **kw), cuda_llm(llama_dir, **kw)
    assert 1 in llm.cuda_graph_sizes["decode"] and calls, "the batch-1 graph captured the inline kernel"
    for adapter in (lora, None):
        for prompt in PROMPTS[1:4]:
            [w], [g] = (x.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False, lora_request=adapter)
                        for x in (cpu, llm))
            want, got = w.outputs[0], g.outputs[0]
            assert got.token_ids == want.token_ids, (adapter, len(prompt))
            torch.testing.assert_close(torch.tensor([lp[t].logprob for lp, t in zip(got.logprobs, got.token_ids)]),
                                       torch.tensor([lp[t].logprob for lp, t in zip(want.logprobs, want.token_ids)]),
                                       atol=1e-3, rtol=0)


def test_batched_prompt_logprobs_on_cuda_equal_the_cpu_engines_alone(llama_dir, tmp_path):
    """Teacher-forced logprobs of prompts batched in 64-token steps on CUDA equal the CPU engine's for
    each prompt alone; and again after a LoRA engine has run on CUDA in this process (session 24:
    a plain engine after three LoRA engines differed by up to 0.26, a fresh one by 2.5e-5)."""
    sequences = [p + [5, 6, 7, 8] for p in PROMPTS[:4]]
    cpu = LLM(str(llama_dir), num_kv_blocks=256)
    want = [scored(cpu, [s], None)[0] for s in sequences]
    for label in ("fresh", "after a LoRA engine"):
        if label != "fresh":
            lora = LoRARequest("r8", 1, str(write_adapter(llama_dir, tmp_path / "r8", 8, 1)))
            scored(cuda_llm(llama_dir, enable_lora=True, max_loras=1, max_lora_rank=8, max_num_batched_tokens=64),
                   sequences, [lora, None, lora, None])
        got = scored(cuda_llm(llama_dir, max_num_batched_tokens=64), sequences, None)
        for s, g, w in zip(sequences, got, want):
            torch.testing.assert_close(torch.tensor(g), torch.tensor(w), atol=1e-4, rtol=0,
                                       msg=lambda m: f"{label}, {len(s)} tokens: {m}")


def test_embeddings_on_cuda_equal_cpu(llama_dir):
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    want = [o.outputs.embedding for o in LLM(str(llama_dir), runner="pooling").embed(prompts, use_tqdm=False)]
    got = [o.outputs.embedding for o in cuda_llm(llama_dir, runner="pooling").embed(prompts, use_tqdm=False)]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v2_lite", "deepseek_v3", "gpt_oss"])
def test_mla_and_gpt_oss_match_transformers_on_cuda(tmp_path, arch):
    """DeepSeek's latent cache and kernels, gpt-oss's sinks, windows and biased MoE, compiled on CUDA
    through captured graphs."""
    model_dir = build_model(arch, tmp_path / arch)
    llm = cuda_llm(model_dir, max_num_batched_tokens=64)
    assert llm.cuda_graph_sizes["decode"]
    got = tokens(llm, PROMPTS)
    mismatched = [i for i, p in enumerate(PROMPTS) if got[i] != hf_greedy(model_dir, p, 8)]
    assert not mismatched, f"prompts {mismatched} differ from transformers"


def test_gpt_oss_mxfp4_experts_on_cuda(tmp_path):
    """gpt-oss's experts packed as shipped (MXFP4), decoded inside the fused MoE GEMMs on CUDA: the
    tokens transformers gives on the dequantized checkpoint."""
    from test_gpt_oss import _mxfp4_checkpoint

    packed, floats = tmp_path / "mxfp4", tmp_path / "float"
    _mxfp4_checkpoint(build_model("gpt_oss", tmp_path / "src"), packed, floats)
    got = tokens(cuda_llm(packed, max_num_batched_tokens=64), PROMPTS)
    mismatched = [i for i, p in enumerate(PROMPTS) if got[i] != hf_greedy(floats, p, 8)]
    assert not mismatched, f"prompts {mismatched} differ from transformers on the dequantized checkpoint"
