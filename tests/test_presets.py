"""make-model presets: HF-loadable directories, deterministic weights, a usable tokenizer."""

import json
import math
import pathlib
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from expresslane.models import presets
from expresslane.models.presets import PRESETS, make_model, num_experts, param_specs, tiny_model_dir
from expresslane.models.tokenizer_builder import SPECIAL_TOKENS, build_tokenizer, special_token_ids

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.\n\n  def f(x):\n\treturn x ** 2  # trailing  ",
    "naïve café, Straße, Ελληνικά, русский, 中文字符, 日本語のテキスト, 한국어",
    "emoji 👩‍👩‍👧‍👦 🇯🇵 e\u0301 \u200b zero-width, \x00\x01 control, \r\n crlf",
    "<|im_start|> in user text stays a special token, yet decodes back",
    "   leading and trailing spaces   ",
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> pathlib.Path:
    return make_model("tiny", tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="module")
def tokenizer(tiny):
    return AutoTokenizer.from_pretrained(tiny)


def test_tiny_loads_in_transformers_and_gives_logits(tiny):
    model, info = AutoModelForCausalLM.from_pretrained(tiny, output_loading_info=True)
    assert not any(info.values()), info
    logits = model(torch.tensor([[1, 2, 3, 4]])).logits
    assert logits.shape == (1, 4, PRESETS["tiny"]["vocab_size"])
    assert torch.isfinite(logits).all()


def test_weights_are_deterministic_per_seed(tiny, tmp_path):
    again = load_file(make_model("tiny", tmp_path / "again") / "model.safetensors")
    other = load_file(make_model("tiny", tmp_path / "other", seed=1) / "model.safetensors")
    first = load_file(tiny / "model.safetensors")
    assert first.keys() == again.keys() == other.keys()
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert not torch.equal(first["model.layers.0.mlp.up_proj.weight"], other["model.layers.0.mlp.up_proj.weight"])
    assert not torch.equal(first["model.layers.0.mlp.up_proj.weight"], first["model.layers.1.mlp.up_proj.weight"])


def test_sharded_weights_match_single_file(tiny, tmp_path, monkeypatch):
    monkeypatch.setattr(presets, "MAX_SHARD_BYTES", 400_000)
    sharded = make_model("tiny", tmp_path / "sharded")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert not (sharded / "model.safetensors").exists()
    assert len(set(index["weight_map"].values())) > 1
    tensors = {}
    for shard in sorted(set(index["weight_map"].values())):
        tensors |= load_file(sharded / shard)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in tensors.values())
    single = load_file(tiny / "model.safetensors")
    assert tensors.keys() == single.keys() == index["weight_map"].keys()
    assert all(torch.equal(tensors[k], single[k]) for k in single)
    _, info = AutoModelForCausalLM.from_pretrained(sharded, output_loading_info=True)
    assert not any(info.values()), info


@pytest.mark.parametrize("preset", [p for p in PRESETS if not num_experts(PRESETS[p])])
def test_every_preset_matches_transformers_parameters(preset, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(PRESETS[preset]))
    config = AutoConfig.from_pretrained(tmp_path)
    assert config.architectures == PRESETS[preset]["architectures"]
    with torch.device("meta"):  # shapes only: no memory, no init cost
        model = AutoModelForCausalLM.from_config(config)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if PRESETS[preset]["tie_word_embeddings"]:
        del expected["lm_head.weight"]
    assert {s.name: s.shape for s in param_specs(PRESETS[preset])} == expected


def test_tokenizer_round_trips_any_text(tokenizer):
    for text in TEXTS:
        ids = tokenizer(text)["input_ids"]
        assert ids[0] == tokenizer.bos_token_id
        assert tokenizer.decode(ids[1:]) == text


def test_english_text_gets_multi_character_tokens(tokenizer):
    text = "The model generates one token at a time, and the server streams them to the user."
    assert len(tokenizer.encode(text, add_special_tokens=False)) < len(text) / 2


def test_every_id_decodes_and_special_tokens_are_on_top(tiny, tokenizer):
    config = json.loads((tiny / "config.json").read_text())
    vocab_size = config["vocab_size"]
    assert len(tokenizer) == vocab_size
    assert all(isinstance(tokenizer.decode([i]), str) for i in range(vocab_size))
    top = tokenizer.convert_ids_to_tokens(list(range(vocab_size - len(SPECIAL_TOKENS), vocab_size)))
    assert top == list(SPECIAL_TOKENS)
    assert config["bos_token_id"] == tokenizer.bos_token_id
    assert config["eos_token_id"] == tokenizer.eos_token_id
    generation = json.loads((tiny / "generation_config.json").read_text())
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in generation["eos_token_id"]


def test_chat_template(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 👋"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ("<|begin_of_text|><|im_start|>system\nBe brief.<|im_end|>\n"
                    "<|im_start|>user\nHi 👋<|im_end|>\n<|im_start|>assistant\n")
    plain = tokenizer.apply_chat_template(messages, tokenize=False)
    assert plain == text.removesuffix("<|im_start|>assistant\n")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert ids.count(tokenizer.bos_token_id) == 1


def test_large_vocab_tokenizer_is_exact_size():
    assert build_tokenizer(152064).get_vocab_size() == 152064


def test_existing_directory_rules(tiny, tmp_path):
    mtime = (tiny / "model.safetensors").stat().st_mtime_ns
    assert make_model("tiny", tiny) == tiny
    assert (tiny / "model.safetensors").stat().st_mtime_ns == mtime
    with pytest.raises(FileExistsError):
        make_model("tiny", tiny, seed=1)
    (tmp_path / "foreign" / "x").mkdir(parents=True)
    with pytest.raises(FileExistsError):
        make_model("tiny", tmp_path / "foreign")
    (tmp_path / "empty").mkdir()
    assert (make_model("tiny", tmp_path / "empty") / "config.json").is_file()
    with pytest.raises(ValueError, match="llama-3-8b"):
        make_model("gpt-5", tmp_path / "nope")


def test_tiny_model_dir_builds_once(tmp_path, monkeypatch):
    monkeypatch.setenv("EXPRESSLANE_CACHE", str(tmp_path))
    with ThreadPoolExecutor(4) as pool:  # concurrent first uses all get the same complete directory
        paths = set(pool.map(lambda _: tiny_model_dir(), range(4)))
    assert paths == {tmp_path / "tiny-seed0-v1"}
    mtime = (tmp_path / "tiny-seed0-v1" / "model.safetensors").stat().st_mtime_ns
    assert tiny_model_dir() == tmp_path / "tiny-seed0-v1"
    assert (tmp_path / "tiny-seed0-v1" / "model.safetensors").stat().st_mtime_ns == mtime
    assert [p.name for p in tmp_path.iterdir()] == ["tiny-seed0-v1"]  # no temporary leftovers


# The mixture-of-experts presets (transformers 5 stacks experts in memory, so its state_dict names
# differ from the per-expert checkpoint names): their parameter counts, and the same configs shrunk
# to a few experts written by make-model, loaded by transformers and by the engine.
@pytest.mark.parametrize("preset,total,active", [("mixtral-8x7b", 46.70e9, 12.88e9), ("qwen3-30b-a3b", 30.53e9, 3.35e9)])
def test_moe_presets_have_the_real_sizes(preset, total, active):
    config = PRESETS[preset]
    specs = param_specs(config)
    numel = {s.name: math.prod(s.shape) for s in specs}
    experts, k = num_experts(config), config["num_experts_per_tok"]
    expert_params = sum(n for name, n in numel.items() if ".experts." in name)
    assert sum(numel.values()) == pytest.approx(total, rel=0.005)
    assert sum(numel.values()) - expert_params * (1 - k / experts) == pytest.approx(active, rel=0.01)


def _shrunk(preset: str) -> dict:
    config = dict(PRESETS[preset], hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, intermediate_size=96, vocab_size=512, max_position_embeddings=512,
                  torch_dtype="float32", dtype="float32")
    ids = special_token_ids(512)
    config |= {"bos_token_id": ids[SPECIAL_TOKENS[0]], "eos_token_id": ids[SPECIAL_TOKENS[1]]}
    if "moe_intermediate_size" in config:
        config |= {"num_experts": 5, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "mlp_only_layers": [1]}
    else:
        config |= {"num_local_experts": 3}
    return config


@pytest.mark.parametrize("preset", ["mixtral-8x7b", "qwen3-30b-a3b"])
def test_moe_preset_loads_in_transformers_and_the_engine(preset, tmp_path, monkeypatch):
    from models import hf_greedy

    from expresslane import LLM, SamplingParams

    monkeypatch.setitem(PRESETS, "shrunk", _shrunk(preset))
    path = make_model("shrunk", tmp_path / "full")
    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not any(info.values()), info
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompt = [5, 77, 300, 12, 9, 400, 31]
    [out] = LLM(str(path)).generate([{"prompt_token_ids": prompt}], greedy, use_tqdm=False)
    assert out.outputs[0].token_ids == hf_greedy(path, prompt, 6)
    # the config and tokenizer alone, with the same weights generated by the engine
    bare = make_model("shrunk", tmp_path / "bare", weights=False)
    assert not list(bare.glob("*.safetensors"))
    [again] = LLM(str(bare), load_format="dummy").generate([{"prompt_token_ids": prompt}], greedy, use_tqdm=False)
    assert again.outputs[0].token_ids == out.outputs[0].token_ids
    with pytest.raises(ValueError, match="fp8 mixture-of-experts"):
        make_model("shrunk", tmp_path / "quantized", quantization="fp8")


@pytest.mark.parametrize("preset,fmt", [("mixtral-8x7b", "awq"), ("qwen3-30b-a3b", "gptq")])
def test_quantized_moe_preset_written_and_dummy_agree(preset, fmt, tmp_path, monkeypatch):
    """make-model --quantization awq|gptq of a MoE preset quantizes the experts too (groups of 128),
    and --load-format dummy generates the same quantized weights on the engine's device."""
    from expresslane import LLM, SamplingParams
    from expresslane.quant.int4_experts import Int4Experts

    wide = dict(hidden_size=128, intermediate_size=128, head_dim=32) | ({"moe_intermediate_size": 128} if fmt == "gptq" else {})
    monkeypatch.setitem(PRESETS, "shrunk", _shrunk(preset) | wide)
    path = make_model("shrunk", tmp_path / "full", quantization=fmt)
    names = safe_open(str(path / "model.safetensors"), "pt").keys()
    assert any(".experts.0." in n and n.endswith(".qweight") for n in names)
    assert not any(".experts." in n and n.endswith(".weight") for n in names)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompt = [5, 77, 300, 12, 9, 400, 31]
    llm = LLM(str(path))
    assert llm.apply_model(lambda model: isinstance(model.layers[0].mlp.w13, Int4Experts)) == [True]
    [out] = llm.generate([{"prompt_token_ids": prompt}], greedy, use_tqdm=False)
    bare = make_model("shrunk", tmp_path / "bare", quantization=fmt, weights=False)
    [again] = LLM(str(bare), load_format="dummy").generate([{"prompt_token_ids": prompt}], greedy, use_tqdm=False)
    assert again.outputs[0].token_ids == out.outputs[0].token_ids


def _shrunk_phi(preset: str) -> dict:
    """A Phi preset at test size; LongRoPE (Phi-3.5) over an original length of 64."""
    config = dict(PRESETS[preset], hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, intermediate_size=96, vocab_size=512, max_position_embeddings=512,
                  torch_dtype="float32", dtype="float32", sliding_window=None, pad_token_id=None)
    ids = special_token_ids(512)
    config |= {"bos_token_id": ids[SPECIAL_TOKENS[0]], "eos_token_id": ids[SPECIAL_TOKENS[1]]}
    if config["rope_scaling"]:
        config |= {"original_max_position_embeddings": 64,
                   "rope_scaling": {"type": "longrope", "short_factor": presets._ramp(8, 1.0, 1.5),
                                    "long_factor": presets._ramp(8, 1.0, 16.0)}}
    return config


def check_shrunk_preset(tmp_path, prompt_len: int, refusal: str) -> None:
    """The "shrunk" preset as make-model writes it: transformers loads every tensor, the engine's
    greedy tokens equal transformers', --load-format dummy generates the same weights, and a
    quantized copy is refused (`refusal`)."""
    from models import hf_greedy

    from expresslane import LLM, SamplingParams

    path = make_model("shrunk", tmp_path / "full")
    _, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not any(info.values()), info
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompt = [(i * 37 + 11) % 500 for i in range(prompt_len)]
    [out] = LLM(str(path)).generate([{"prompt_token_ids": prompt}], greedy, use_tqdm=False)
    assert out.outputs[0].token_ids == hf_greedy(path, prompt, 6)
    bare = make_model("shrunk", tmp_path / "bare", weights=False)
    [again] = LLM(str(bare), load_format="dummy").generate([{"prompt_token_ids": prompt}], greedy, use_tqdm=False)
    assert again.outputs[0].token_ids == out.outputs[0].token_ids
    with pytest.raises(ValueError, match=refusal):
        make_model("shrunk", tmp_path / "quantized", quantization="awq")


@pytest.mark.parametrize("preset", ["phi-3.5-mini", "phi-4"])
def test_phi_preset_loads_in_transformers_and_the_engine(preset, tmp_path, monkeypatch):
    """Fused qkv_proj / gate_up_proj checkpoints as make-model writes them: transformers loads every
    tensor, the engine's tokens equal transformers' (a prompt crossing LongRoPE's original length),
    and --load-format dummy generates the same weights."""
    monkeypatch.setitem(PRESETS, "shrunk", _shrunk_phi(preset))
    check_shrunk_preset(tmp_path, prompt_len=70, refusal="fused-projection")


# DeepSeek (MLA, shared experts, DeepSeek routing): the real parameter counts, and each preset shrunk
# to test size: written by make-model, loaded by transformers (every tensor) and by the engine
@pytest.mark.parametrize("preset,total", [("deepseek-v2-lite", 15.71e9), ("deepseek-v3", 671.0e9)])
def test_deepseek_presets_have_the_real_sizes(preset, total):
    assert sum(math.prod(s.shape) for s in param_specs(PRESETS[preset])) == pytest.approx(total, rel=0.002)


def _shrunk_deepseek(preset: str) -> dict:
    config = dict(PRESETS[preset], hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                  intermediate_size=96, vocab_size=512, max_position_embeddings=512, torch_dtype="float32",
                  dtype="float32", kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, head_dim=8,
                  v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                  first_k_dense_replace=1, rope_scaling=dict(PRESETS[preset]["rope_scaling"], factor=4.0,
                                                             original_max_position_embeddings=128))
    if config["q_lora_rank"]:
        config |= {"q_lora_rank": 24, "n_group": 4, "topk_group": 2}
    ids = special_token_ids(512)
    return config | {"bos_token_id": ids[SPECIAL_TOKENS[0]], "eos_token_id": ids[SPECIAL_TOKENS[1]]}


@pytest.mark.parametrize("preset", ["deepseek-v2-lite", "deepseek-v3"])
def test_deepseek_preset_loads_in_transformers_and_the_engine(preset, tmp_path, monkeypatch):
    monkeypatch.setitem(PRESETS, "shrunk", _shrunk_deepseek(preset))
    check_shrunk_preset(tmp_path, prompt_len=40, refusal="quantized DeepSeek presets")


# gpt-oss: the shipped checkpoint's layout (MXFP4 experts, sinks, biases), its real size, and a shrunk
# copy read by transformers' own MXFP4 loader (dequantized) and by the engine
def test_gpt_oss_preset_has_the_real_size():
    config = PRESETS["gpt-oss-20b"]
    numel = {s.name: math.prod(s.shape) * (2 if s.name.endswith("_blocks") else 1)  # two FP4 values a byte
             for s in param_specs(config) if not s.name.endswith("_scales")}
    experts = sum(n for name, n in numel.items() if ".experts." in name)
    embedding = numel["model.embed_tokens.weight"]  # (OpenAI's active count leaves it out)
    assert sum(numel.values()) == pytest.approx(20.91e9, rel=0.005)
    assert sum(numel.values()) - embedding - experts * (1 - 4 / 32) == pytest.approx(3.61e9, rel=0.01)


def _shrunk_gpt_oss() -> dict:
    from expresslane.models import harmony

    config = dict(PRESETS["gpt-oss-20b"], hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, intermediate_size=64, vocab_size=512,
                  max_position_embeddings=1024, torch_dtype="float32", dtype="float32", num_local_experts=5, num_experts_per_tok=2, sliding_window=8,
                  layer_types=["sliding_attention", "full_attention"])
    config["rope_scaling"] = dict(config["rope_scaling"], factor=4.0, original_max_position_embeddings=256)
    ids = special_token_ids(512, harmony.SPECIAL_TOKENS)
    return config | {"bos_token_id": ids[harmony.STARTOFTEXT], "eos_token_id": ids[harmony.RETURN]}


def test_gpt_oss_preset_loads_as_shipped(tmp_path, monkeypatch):
    from transformers import Mxfp4Config

    from expresslane import LLM, SamplingParams

    monkeypatch.setitem(PRESETS, "shrunk", _shrunk_gpt_oss())
    path = make_model("shrunk", tmp_path / "full")
    names = safe_open(str(path / "model.safetensors"), "pt").keys()
    assert "model.layers.0.mlp.experts.gate_up_proj_blocks" in names and "model.layers.0.self_attn.sinks" in names
    hf, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True, dtype=torch.float32,
                                                    quantization_config=Mxfp4Config(dequantize=True))
    assert not any(info.values()), info
    prompt = [(i * 37 + 11) % 500 for i in range(40)]  # past the window of 8
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                       eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    [out] = LLM(str(path)).generate([{"prompt_token_ids": prompt}], greedy, use_tqdm=False)
    assert out.outputs[0].token_ids == want
    bare = make_model("shrunk", tmp_path / "bare", weights=False)
    [again] = LLM(str(bare), load_format="dummy").generate([{"prompt_token_ids": prompt}], greedy, use_tqdm=False)
    assert again.outputs[0].token_ids == want
    with pytest.raises(ValueError, match="as shipped"):
        make_model("shrunk", tmp_path / "quantized", quantization="awq")
