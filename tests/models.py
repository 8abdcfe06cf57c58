"""Tiny random models of each supported architecture, built with transformers' own
classes (seeded) and saved as Hugging Face directories. Nothing is downloaded."""

from __future__ import annotations

from pathlib import Path

import torch

from expresslane.models import harmony
from expresslane.models.tokenizer_builder import BOS, EOS, save_tokenizer, special_token_ids

VOCAB = 512
_IDS = special_token_ids(VOCAB)
_HARMONY = special_token_ids(VOCAB, harmony.SPECIAL_TOKENS)  # gpt-oss's tokenizer: harmony's at the top

_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
               rms_norm_eps=1e-6, bos_token_id=_IDS[BOS], eos_token_id=_IDS[EOS], tie_word_embeddings=False)

ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 128}, rope_theta=10000.0)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None, head_dim=16)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True, rope_theta=1e6)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, rope_theta=1e6)),
    # mixtures of experts, odd expert counts: top-2 renormalised; top-1 not renormalised (its weight is the
    # softmax's), with layer 1 dense
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=5, num_experts_per_tok=2,
                                                            sliding_window=None)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        num_experts=7, num_experts_per_tok=1, norm_topk_prob=False, moe_intermediate_size=48, mlp_only_layers=[1],
        head_dim=32, rope_theta=1e6)),
    # Gemma: the window (512) caps max_model_len, so every layer sees the whole context (exact);
    # soft-caps low enough to bind; Gemma 3 with its two RoPE bases, the global one linearly scaled
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        head_dim=16, query_pre_attn_scalar=24, sliding_window=512, attn_logit_softcapping=3.0,
        final_logit_softcapping=10.0, tie_word_embeddings=True)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        head_dim=32, query_pre_attn_scalar=32, sliding_window=512, layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                         "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}},
        tie_word_embeddings=True)),
    # Phi-3: fused qkv_proj / gate_up_proj checkpoint tensors, 3/4 of each head rotated, LongRoPE over an
    # original length of 128 (the test prompts run under it, across it and past it while decoding)
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(
        original_max_position_embeddings=128, partial_rotary_factor=0.75, sliding_window=None, pad_token_id=None,
        rope_scaling={"type": "longrope", "short_factor": [1.0, 1.05, 1.1, 1.3, 1.6, 2.0],
                      "long_factor": [1.0, 1.5, 2.5, 4.0, 8.0, 16.0]})),
    # RoPE scaling of the families above: linear, dynamic NTK (past max_position_embeddings, 128 here:
    # the prompts run under and over it) and YaRN (its attention factor scales cos and sin)
    "llama_linear": ("LlamaConfig", "LlamaForCausalLM", dict(rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "llama_dynamic": ("LlamaConfig", "LlamaForCausalLM", dict(
        max_position_embeddings=128, rope_scaling={"rope_type": "dynamic", "factor": 4.0})),
    "qwen2_yarn": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        rope_theta=1e6, rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256})),
}


_MLA = dict(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, num_key_value_heads=None,
            first_k_dense_replace=1)
_MOE = dict(n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=32)

# built only where a test asks for them
MORE_ARCHS = {
    # Ministral: Mistral with a window on the layers `layer_types` names (here the first of two)
    "ministral": ("MinistralConfig", "MinistralForCausalLM", dict(
        head_dim=16, sliding_window=24, layer_types=["sliding_attention", "full_attention"])),
    # DeepSeek (MLA: the latent cache, absorbed decode). V2: q_lora_rank set, group-limited routing with
    # routed scaling, YaRN with mscale_all_dim (the softmax scale too); V2-Lite: q_proj (no q_lora_rank),
    # greedy routing; V3: sigmoid + correction bias, noaux_tc groups, renormalised; layer 0 dense in each
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(_MLA, **_MOE, q_lora_rank=24,
        topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=2.0,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "mscale": 0.707,
                      "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1})),
    "deepseek_v2_lite": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(_MLA, **_MOE, q_lora_rank=None,
                                                                           topk_method="greedy")),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(_MLA, **_MOE, q_lora_rank=24, n_group=4,
                                                                      topk_group=2, routed_scaling_factor=2.5,
                                                                      norm_topk_prob=True)),
    # gpt-oss: a window of 24 on the first of two layers, sinks, 5 experts top-2 with biases, the SwiGLU's
    # clamp low enough to bind, YaRN over an original 256 positions; the harmony tokenizer and template
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        bos_token_id=_HARMONY[harmony.STARTOFTEXT], eos_token_id=[_HARMONY[t] for t in harmony.STOP_TOKENS],
        head_dim=16, sliding_window=24, layer_types=["sliding_attention", "full_attention"], num_local_experts=5,
        num_experts_per_tok=2, intermediate_size=64, swiglu_limit=1.0,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 256, "rope_theta": 150000.0})),
}


def build_model(arch: str, out_dir: Path, seed: int = 0, peak: float = 8.0, **overrides) -> Path:
    """A seeded random model whose next-token distributions are peaky (few near-ties);
    `overrides`: config fields over the arch's (e.g. sliding_window)."""
    import transformers

    config_name, model_name, extra = ARCHS[arch] if arch in ARCHS else MORE_ARCHS[arch]
    config = getattr(transformers, config_name)(**{**_COMMON, **extra, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:  # wider weights than the 0.02 default: hidden states that depend on the input
                p.normal_(0.0, 0.15 if "embed" not in name else 1.0)
            elif "bias" in name:
                p.normal_(0.0, 0.1)
            elif name.endswith("sinks"):  # gpt-oss: sinks that take a share of the attention
                p.normal_(0.0, 1.0)
            elif arch.startswith("gemma"):  # its norms scale by (1 + w), w zero at init
                p.normal_(0.0, 0.2)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's router bias (zeros at init)
                b.normal_(0.0, 0.1)
        head = model.get_output_embeddings().weight
        if arch.startswith("gemma"):  # tied and scaled by sqrt(hidden): small rows, or each token's own embedding
            head.div_(head.norm(dim=-1, keepdim=True).mean() * 8.0)  # wins (greedy repeats it); the peak goes
            model.model.norm.weight.add_(4.0 * peak - 1.0)  # into the final (1 + w) norm instead
        else:
            head.mul_(peak / head.norm(dim=-1, keepdim=True).mean())
    if arch == "gpt_oss":  # older transformers (5.17: the GPU machine's) fix the clamp at 7.0 whatever the config says:
        experts = model.model.layers[0].mlp.experts  # the config names the reference's own, which the engine reads
        model.config.swiglu_limit, model.config.swiglu_alpha = experts.limit, experts.alpha
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    save_tokenizer(VOCAB, out_dir, config.max_position_embeddings, harmony=arch == "gpt_oss")
    return out_dir


def make_lora_adapter(model_dir: Path, out: Path, rank: int, targets: list[str], rslora: bool = False,
                      seed: int = 0) -> Path:
    """A peft LoRA adapter of `model_dir` with random, non-zero A and B (peft starts B at zero),
    saved as PEFT saves it (adapter_config.json, adapter_model.safetensors)."""
    import peft
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, lora_dropout=0.0,
                             use_rslora=rslora)
    model = peft.get_peft_model(model, config)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.1)
    model.save_pretrained(out)
    return out


def hf_greedy(model_dir: Path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy continuation (float32, CPU): the reference."""
    model = _hf_model(model_dir)
    _fresh_rope(model)
    out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                         max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
                         min_new_tokens=max_new_tokens)
    return out[0, len(prompt_ids):].tolist()


_CACHE: dict[Path, object] = {}


def _fresh_rope(model) -> None:
    """transformers' dynamic RoPE keeps the longest length it has seen across calls (a later, shorter
    prompt reuses its frequencies): each reference starts from a fresh module's state."""
    for module in model.modules():
        if getattr(module, "rope_type", None) == "dynamic":
            module.register_buffer("inv_freq", module.original_inv_freq.clone(), persistent=False)
            module.max_seq_len_cached = module.original_max_seq_len


def _hf_model(model_dir: Path):
    from transformers import AutoModelForCausalLM

    if model_dir not in _CACHE:  # eager: transformers' own attention (SDPA leaves out soft-caps and sinks)
        _CACHE[model_dir] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                                 attn_implementation="eager").eval()
    return _CACHE[model_dir]


def multimodal_checkpoint(text_dir, out):
    """A Gemma3ForConditionalGeneration directory (transformers' class, a tiny vision tower) whose
    language model holds `text_dir`'s weights, with its tokenizer; as the hub ships Gemma 3 4b-27b."""
    import shutil

    from transformers import (AutoModelForCausalLM, Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig,
                              SiglipVisionConfig)

    text = Gemma3TextConfig.from_pretrained(text_dir)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=14)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=497,
                          boi_token_index=498, eoi_token_index=499, eos_token_id=[1, 2])
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config).float().eval()
    source = AutoModelForCausalLM.from_pretrained(text_dir, dtype=torch.float32)
    model.model.language_model.load_state_dict(source.model.state_dict())
    model.save_pretrained(out)
    for f in text_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, out / f.name)
    return out, model


def exact_attention(q, kv, meta, scale: float, window: int | None = None, sinks=None, block_size: int = 16):
    """Each seq's attention over its paged keys in float64, the window as transformers masks it, and
    each head's sink (gpt-oss) in the softmax's denominator, its weight dropped: the kernels' reference."""
    out = torch.empty_like(q)
    starts, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
    group = q.shape[1] // kv.shape[3]
    for i, ctx in enumerate(lens):
        lo, hi = starts[i], starts[i + 1]
        pos = torch.arange(ctx)
        blocks = meta.block_tables[i].cpu().long()[pos // block_size]
        keys, values = (kv[j].cpu()[blocks, pos % block_size].double().repeat_interleave(group, 1) for j in (0, 1))
        q_pos = torch.arange(ctx - (hi - lo), ctx)[:, None]
        seen = pos[None, :] <= q_pos
        if window is not None:
            seen &= pos[None, :] > q_pos - window
        scores = torch.einsum("thd,khd->htk", q[lo:hi].cpu().double(), keys) * scale
        scores = scores.masked_fill(~seen[None], float("-inf"))
        if sinks is not None:
            sink = sinks.cpu().double()[:, None, None].expand(-1, hi - lo, 1)
            weights = torch.cat([scores, sink], -1).softmax(-1)[..., :-1]
        else:
            weights = scores.softmax(-1)
        out[lo:hi] = torch.einsum("htk,khd->thd", weights, values).to(out.dtype).to(out.device)
    return out


def triton_through_graphs(model_dir: Path, prompts: list[list[int]], refs: list[list[int]], num_kv_blocks: int):
    """The Triton kernels in the engine (the interpreter on CPU) through the CUDA-graph input path,
    with chunks, prefix hits and preemption: greedy tokens equal `refs` (transformers'); the LLM."""
    from expresslane import LLM, SamplingParams

    picked = [0, 4, 9, 15, 17, 19]  # short, mid and long prompts; three sharing a prefix, one twice
    llm = LLM(str(model_dir), attention_backend="triton", max_num_batched_tokens=48, max_num_seqs=6,
              max_model_len=384, num_kv_blocks=num_kv_blocks)
    llm.engine.runner.build_graphs(llm.config.model.max_model_len, capture=False)
    greedy = SamplingParams(temperature=0.0, max_tokens=len(refs[0]), ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": prompts[i]} for i in picked], greedy, use_tqdm=False)
    mismatched = [i for i, o in zip(picked, outs) if o.outputs[0].token_ids != refs[i]]
    assert not mismatched, f"prompts {mismatched} differ from transformers"
    core = llm.engine.core
    assert core.scheduler.num_preemptions > 0 and max(o.num_cached_tokens for o in outs) > 0
    return llm
