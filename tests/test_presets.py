"""make-model presets: HF-loadable directories, deterministic weights, a usable tokenizer."""

import json
import pathlib
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from expresslane.models import presets
from expresslane.models.presets import PRESETS, default_model_dir, make_model, param_specs
from expresslane.models.tokenizer_builder import SPECIAL_TOKENS, build_tokenizer

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


@pytest.mark.parametrize("preset", list(PRESETS))
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


def test_default_model_dir_builds_once(tmp_path, monkeypatch):
    monkeypatch.setenv("EXPRESSLANE_CACHE", str(tmp_path))
    with ThreadPoolExecutor(4) as pool:  # concurrent first uses all get the same complete directory
        paths = set(pool.map(lambda _: default_model_dir(), range(4)))
    assert paths == {tmp_path / "tiny-seed0-v1"}
    mtime = (tmp_path / "tiny-seed0-v1" / "model.safetensors").stat().st_mtime_ns
    assert default_model_dir() == tmp_path / "tiny-seed0-v1"
    assert (tmp_path / "tiny-seed0-v1" / "model.safetensors").stat().st_mtime_ns == mtime
    assert [p.name for p in tmp_path.iterdir()] == ["tiny-seed0-v1"]  # no temporary leftovers
