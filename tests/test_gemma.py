"""Gemma 2 and Gemma 3 (text) against transformers (float32, CPU), beyond the greedy tokens
test_equivalence.py checks for every architecture: logprobs, the soft-caps in the Triton kernels
(through the interpreter), the per-layer RoPE tables and windows, and the refusals."""

import logging
import random

import pytest
import torch
from models import build_model, hf_greedy, multimodal_checkpoint

from expresslane import LLM, SamplingParams
from expresslane.attention.torch_backend import TorchAttentionBackend
from expresslane.models.gemma import Gemma2ForCausalLM
from expresslane.models.model_dir import load_hf_config

ATOL = 1e-4  # float32, different kernels


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(500) for _ in range(n)]


def model_of(llm: LLM):
    """The engine's model (one process: apply_model hands back the object itself)."""
    [model] = llm.apply_model(lambda model: model)
    return model


def hf_log_softmax(model_dir, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_logprobs_match_transformers(model_dirs, arch):
    """Prompt logprobs (every position) and the sampled tokens' logprobs equal transformers'
    log-softmax, the final soft-cap (gemma2) included; in 16-token chunks."""
    ids = prompt(40, seed=1)
    llm = LLM(str(model_dirs[arch]), max_num_batched_tokens=16)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=1, prompt_logprobs=1)
    out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
    tokens = out.outputs[0].token_ids
    ref = hf_log_softmax(model_dirs[arch], ids + tokens)
    for i in range(1, len(ids)):
        assert out.prompt_logprobs[i][ids[i]].logprob == pytest.approx(ref[i - 1, ids[i]].item(), abs=ATOL), i
    for j, (tok, lps) in enumerate(zip(tokens, out.outputs[0].logprobs)):
        row = ref[len(ids) - 1 + j]
        assert tok == int(row.argmax())
        assert lps[tok] == pytest.approx(row[tok].item(), abs=ATOL), j


def test_final_softcap_binds(model_dirs):
    """The tiny Gemma 2's logits reach well past its final cap (so the test above sees the cap
    work), and our capped logits of the same hidden states are transformers' capped ones."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dirs["gemma2"], dtype=torch.float32).eval()
    model = model_of(LLM(str(model_dirs["gemma2"])))
    with torch.no_grad():
        hidden = hf.model(torch.tensor([prompt(40, seed=1)])).last_hidden_state[0]
        raw, ours = hf.lm_head(hidden), model.compute_logits(hidden)
    cap = hf.config.final_logit_softcapping
    assert raw.abs().max() > 1.5 * cap > cap > ours.abs().max()
    torch.testing.assert_close(ours, cap * torch.tanh(raw / cap))


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_triton_backend_matches_transformers(model_dirs, arch):
    """The Triton kernels (the interpreter on CPU), the attention soft-cap in them (gemma2), through
    the CUDA-graph input path: chunks, a prefix-cache hit and preemption."""
    pytest.importorskip("triton")
    shared = prompt(40, seed=2)
    prompts = [shared + prompt(9, 5), prompt(1, 3), prompt(70, 4), shared + prompt(30, 6)]
    llm = LLM(str(model_dirs[arch]), attention_backend="triton", max_num_batched_tokens=48, max_num_seqs=4,
              max_model_len=128, num_kv_blocks=8, scheduling_policy="fcfs")
    llm.engine.runner.build_graphs(llm.config.model.max_model_len, capture=False)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = [llm.generate([{"prompt_token_ids": prompts[0]}], greedy, use_tqdm=False)[0]]  # its blocks cached
    outs += llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], greedy, use_tqdm=False)
    mismatched = [i for i, (o, p) in enumerate(zip(outs, prompts)) if o.outputs[0].token_ids != hf_greedy(
        model_dirs[arch], p, 8)]
    assert not mismatched, f"prompts {mismatched} differ from transformers"
    assert llm.engine.core.scheduler.num_preemptions > 0 and max(o.num_cached_tokens for o in outs) > 0


def test_triton_kernel_softcap_matches_torch():
    """The kernels' constexpr-guarded tanh cap against the torch reference, decodes and prefill
    chunks over cached keys, with the cap binding (scores well past it)."""
    pytest.importorskip("triton")
    from test_triton_attention import make_step

    from expresslane.attention.triton_backend import TritonAttentionBackend

    seqs = [(0, 1), (37, 1), (0, 9), (20, 25)]
    q, k, v, kv, meta, _ = make_step(seqs, 4, 2, 16, 16, torch.float32, seed=7)
    q = q * 4  # scores of ~16 x the scale: far past the cap
    kv[0].copy_(kv[0] * 4)
    scale, cap = 16 ** -0.5, 2.0
    backend = TritonAttentionBackend(4, 2, 16, q.device)
    backend.prepare(meta)
    out = backend.attend(q, kv, meta, scale, softcap=cap)
    ref = TorchAttentionBackend().attend(q, kv, meta, scale, softcap=cap)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    uncapped = TorchAttentionBackend().attend(q, kv, meta, scale)
    assert (uncapped - ref).abs().max() > 0.1  # the cap changed the result


def test_layers_windows_and_rope_bases_match_transformers(model_dirs):
    """Gemma 3's sliding layer: the window and the local RoPE base; its global layer: no window,
    the global base with linear scaling. Both tables equal transformers' cos/sin."""
    from transformers import AutoModelForCausalLM

    model = model_of(LLM(str(model_dirs["gemma3"])))
    hf = AutoModelForCausalLM.from_pretrained(model_dirs["gemma3"], dtype=torch.float32).eval()
    pos = torch.arange(300)[None]
    x = torch.zeros(1, 300, 8)
    tables = []
    for layer, kind, window in ((model.layers[0], "sliding_attention", 512), (model.layers[1], "full_attention", None)):
        assert layer.self_attn.sliding_window == window
        cos, sin = hf.model.rotary_emb(x, pos, kind)
        half = cos.shape[-1] // 2
        table = layer.self_attn.rotary.cos_sin[:300]
        torch.testing.assert_close(table, torch.cat([cos[0, :, :half], sin[0, :, :half]], -1), rtol=1e-6, atol=1e-6)
        tables.append(table)
    assert (tables[0] - tables[1]).abs().max() > 0.1
    g2 = model_of(LLM(str(model_dirs["gemma2"])))
    assert [layer.self_attn.sliding_window for layer in g2.layers] == [512, None]


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_windows_past_the_prompt_match_transformers(arch, tmp_path):
    """A window of 24 tokens on the sliding layers, prompts past it in 16-token chunks: tokens as
    transformers'; max_model_len is the model's, and the sliding layers' KV group frees the blocks
    that leave the window while the global layers' keeps them."""
    d = build_model(arch, tmp_path / arch, sliding_window=24)
    llm = LLM(str(d), max_num_batched_tokens=16)
    assert llm.config.model.max_model_len == load_hf_config(d).max_position_embeddings
    prompts = [[(7 * i + 3 * j) % 500 for j in range(n)] for i, n in enumerate((40, 100))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=8,
                                                                                   ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(d, p, 8) for p in prompts]
    assert llm.engine.runner.kv_groups == (24, None) and llm.engine.core.kv.window_freed_blocks > 0


def test_a_request_of_8x_the_window_holds_the_window_in_its_sliding_layers(tmp_path, caplog):
    """Gemma 3, a window of 32 on its sliding layer (blocks of 16), a 40-token prompt that runs to
    8x the window in one-block steps: after every plan the sliding layer's KV group holds at most
    the window and one block, the global layer's every block so far; tokens as transformers'."""
    d = build_model("gemma3", tmp_path / "gemma3", sliding_window=32)
    with caplog.at_level(logging.INFO, logger="expresslane.engine.core"):
        llm = LLM(str(d), max_num_batched_tokens=16, enable_prefix_caching=False)
    assert "sliding windows (KV groups (32, None))" in caplog.text
    core = llm.engine.core
    held = []
    real = core.scheduler.schedule
    core.scheduler.schedule = lambda: (plan := real(), held.append((core.kv.num_held_blocks(group=0),
                                                                    core.kv.num_held_blocks(group=1))))[0]
    ids = prompt(40, 11)
    max_tokens = 8 * 32 - len(ids)
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                   ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(d, ids, max_tokens)
    assert len(held) >= max_tokens and max(sliding for sliding, _ in held) == 32 // 16 + 1
    assert max(full for _, full in held) == 8 * 32 // 16
    assert core.kv.window_freed_blocks == 8 * 32 // 16 - (32 // 16 + 1)


def test_refusals(model_dirs):
    """The fused decode layer, the library prefill path with a soft-cap, and bad config fields."""
    from expresslane.attention.registry import get_backend

    model = model_of(LLM(str(model_dirs["gemma2"])))
    assert "Gemma" in model.fused_decode_refusal()
    with pytest.raises(ValueError, match="fused decode layer cannot run Gemma"):
        model.enable_fused_decode()
    if pytest.importorskip("triton"):
        with pytest.raises(ValueError, match="attn_logit_softcapping"):
            get_backend("triton", 4, 2, 16, torch.device("cpu"), torch.float32, "cudnn", softcap=3.0)
        assert not get_backend("triton", 4, 2, 16, torch.device("cpu"), torch.float32, "auto", softcap=3.0).library
    cfg = load_hf_config(model_dirs["gemma2"])
    cfg.hidden_activation = "relu"
    with pytest.raises(ValueError, match="hidden_activation 'relu'"):
        Gemma2ForCausalLM(cfg, TorchAttentionBackend())
    cfg = load_hf_config(model_dirs["gemma2"])
    cfg.layer_types = ["sliding_attention"]
    with pytest.raises(ValueError, match="layer_types must list 2 entries"):
        Gemma2ForCausalLM(cfg, TorchAttentionBackend())


@pytest.mark.parametrize("preset,params", [("gemma-2-9b", 9.24e9), ("gemma-3-12b", 11.77e9)])
def test_presets_have_the_real_size_and_load_shrunk(preset, params, tmp_path, monkeypatch):
    """make-model's Gemma presets: the real parameter count; shrunk, transformers and the engine
    (from the files, and from `--load-format dummy`) give the same greedy tokens."""
    import math

    from transformers import AutoModelForCausalLM

    from expresslane.models import presets
    from expresslane.models.tokenizer_builder import BOS, EOS, special_token_ids

    config = presets.PRESETS[preset]
    assert sum(math.prod(s.shape) for s in presets.param_specs(config)) == pytest.approx(params, rel=0.005)
    ids = special_token_ids(512)
    shrunk = dict(config, hidden_size=64, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, intermediate_size=96, vocab_size=512, max_position_embeddings=512, sliding_window=256,
                  torch_dtype="float32", dtype="float32", layer_types=config["layer_types"][:6],
                  bos_token_id=ids[BOS], eos_token_id=ids[EOS])
    monkeypatch.setitem(presets.PRESETS, "shrunk", shrunk)
    path = presets.make_model("shrunk", tmp_path / "full")
    _, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not any(info.values()), info
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    ids = [5, 77, 300, 12, 9, 400, 31]
    [out] = LLM(str(path)).generate([{"prompt_token_ids": ids}], greedy, use_tqdm=False)
    assert out.outputs[0].token_ids == hf_greedy(path, ids, 6)
    bare = presets.make_model("shrunk", tmp_path / "bare", weights=False)
    [again] = LLM(str(bare), load_format="dummy").generate([{"prompt_token_ids": ids}], greedy, use_tqdm=False)
    assert again.outputs[0].token_ids == out.outputs[0].token_ids


# Gemma's own template, shortened: turns of user and model, no system role
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\\n' + m['content'] + "
    "'<end_of_turn>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}")


def test_chat_template_from_the_tokenizer_directory(model_dirs, tmp_path):
    """A Gemma directory's own chat template formats the chat, and its refusal of a system
    message is the client's error, as for any family."""
    import json
    import shutil

    from expresslane.server import errors
    from expresslane.server.protocol import ChatMessage
    from expresslane.server.serving import chat_prompt
    from expresslane.tokenizer import load_tokenizer

    path = shutil.copytree(model_dirs["gemma3"], tmp_path / "gemma3")
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": GEMMA_TEMPLATE}))
    tokenizer = load_tokenizer(path)
    text, ids = chat_prompt(tokenizer, [ChatMessage(role="user", content="hi")], add_generation_prompt=True)
    assert text == tokenizer.bos_token + "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n"
    assert ids == tokenizer.encode(text, add_special_tokens=False)
    with pytest.raises(errors.APIError, match="System role not supported"):
        chat_prompt(tokenizer, [ChatMessage(role="system", content="be brief")], add_generation_prompt=True)


def test_multimodal_checkpoint_serves_its_text_model(model_dirs, tmp_path):
    """Gemma 3 4b-27b ship as Gemma3ForConditionalGeneration: its text model loads (the vision tower is
    left out) and gives transformers' multimodal class's greedy tokens on text, its top-level eos ids
    kept; random weights of its shape (`load_format dummy`) load too."""
    path, hf = multimodal_checkpoint(model_dirs["gemma3"], tmp_path / "gemma3-mm")
    llm = LLM(str(path), max_num_batched_tokens=16)
    assert llm.engine.core.hf_config.eos_token_id == [1, 2]
    prompts = [prompt(n, seed=n) for n in (1, 17, 40)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0.0, max_tokens=6,
                                                                                   ignore_eos=True), use_tqdm=False)
    for p, out in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False, min_new_tokens=6)[0, len(p):]
        assert out.outputs[0].token_ids == ref.tolist() == hf_greedy(model_dirs["gemma3"], p, 6)
    dummy = LLM(str(path), load_format="dummy")
    assert len(dummy.generate(["hi"], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)[0].outputs[0]
               .token_ids) == 2


def test_multimodal_checkpoint_tensors_of_neither_side_are_named(model_dirs, tmp_path):
    from expresslane.models.gemma import text_weights

    with pytest.raises(ValueError, match="'audio_tower.x'"):
        list(text_weights([("language_model.model.norm.weight", torch.ones(1)), ("audio_tower.x", torch.ones(1))]))
    assert [n for n, _ in text_weights([("model.language_model.norm.weight", 0), ("vision_tower.a", 0),
                                        ("language_model.lm_head.weight", 0), ("model.norm.weight", 0)])] == [
        "model.norm.weight", "lm_head.weight", "model.norm.weight"]


def test_kv_groups_through_calibration(tmp_path):
    """Gemma 3's two KV groups through the start-up calibration's timed steps (every group gets its
    block ids): the engine starts and its tokens are transformers'."""
    d = build_model("gemma3", tmp_path / "gemma3", sliding_window=24)
    llm = LLM(str(d), step_cost_model="calibrate", max_num_batched_tokens=64)
    ids = prompt(60, 12)
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                       use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(d, ids, 8)
    assert llm.engine.runner.kv_groups == (24, None)


def test_kv_groups_through_prompt_lookup(tmp_path):
    """ngram verify steps of k + 1 tokens over Gemma 3's two KV groups (the nominal cost model, so
    the choice to speculate does not follow this machine's speed): tokens as transformers', blocks
    freed behind the window."""
    d = build_model("gemma3", tmp_path / "gemma3", sliding_window=24)
    llm = LLM(str(d), speculative_method="ngram", num_speculative_tokens=3, speculative_disable_by_batch_size=64,
              max_num_batched_tokens=64, scheduling_policy="fcfs")
    base = [(7 * j) % 50 + 3 for j in range(20)]
    prompts = [base * 4, (base[:10] * 6)[:55]]  # repetitive: the proposals come from the prompt
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=40,
                                                                                   ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(d, p, 40) for p in prompts]
    core = llm.engine.core
    assert llm.engine.runner.kv_groups == (24, None) and core.kv.window_freed_blocks > 0
    assert core.spec.counters.num_draft_tokens > 0
