"""Model directories and their config.json, without torch: the API process reads them too
(it tokenizes and detokenizes; only the engine process loads weights)."""

from __future__ import annotations

import json
import os
import pathlib
from pathlib import Path

FORMAT_VERSION = 1  # of the directories make-model writes; part of the default model's cache path


# The built-in pair, shipped with the package: a ~9M-parameter Llama trained on the Python
# standard library's source, and a ~2M draft with the same tokenizer (benchmarks/train_pair.py;
# each directory's training.json holds the recipe, held-out loss and sample completions).
DATA_DIR = Path(__file__).parent / "data"
DEFAULT_MODEL = DATA_DIR / "stdlib-llama-9m"
DEFAULT_DRAFT_MODEL = DATA_DIR / "stdlib-llama-2m-draft"


def cache_dir() -> Path:
    """Where built models are cached (random presets the tests and benchmarks build)."""
    return pathlib.Path(os.environ.get("EXPRESSLANE_CACHE") or pathlib.Path.home() / ".cache" / "expresslane")


def default_model_path() -> Path:
    """The built-in default model: the trained target of the shipped pair."""
    return DEFAULT_MODEL


def check_model_dir(path: str | Path) -> Path:
    p = Path(path)
    if not p.is_dir():
        raise FileNotFoundError(f"model directory {str(p)!r} does not exist")
    if not (p / "config.json").is_file():
        raise FileNotFoundError(f"model directory {str(p)!r} has no config.json")
    return p


def read_config(path: str | Path) -> dict:
    """config.json as plain JSON (transformers' AutoConfig imports torch when it is installed)."""
    p = check_model_dir(path)
    try:
        return json.loads((p / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"broken config.json in {str(p)!r}: {e}") from e


# Multimodal checkpoints whose text model is served (their vision tower is not loaded; requests
# carry text only): the checkpoint's architecture -> the text model's
TEXT_MODEL_OF = {"Gemma3ForConditionalGeneration": "Gemma3ForCausalLM"}
# what the text section takes from the top level of config.json (the special tokens: the top's win)
_TOP_LEVEL_TOKENS = ("eos_token_id", "bos_token_id", "pad_token_id")


def _wrapper(architectures) -> str | None:
    return next((a for a in architectures or () if a in TEXT_MODEL_OF), None)


def text_config(config: dict) -> dict:
    """config.json as the served model reads it: a TEXT_MODEL_OF checkpoint's `text_config`
    (which may leave fields at their class defaults, e.g. `vocab_size`), else `config` itself."""
    wrapper = _wrapper(config.get("architectures"))
    if wrapper is None or not isinstance(config.get("text_config"), dict):
        return config
    text = {**config["text_config"], **{k: config[k] for k in _TOP_LEVEL_TOKENS if config.get(k) is not None}}
    for key in ("dtype", "torch_dtype"):
        if key in config:
            text.setdefault(key, config[key])
    return {**text, "architectures": [TEXT_MODEL_OF[wrapper]], "served_text_of": wrapper}


def load_hf_config(path: str | Path):
    """transformers' config of the served model (a multimodal checkpoint's text config, see TEXT_MODEL_OF)."""
    from transformers import AutoConfig

    p = check_model_dir(path)
    try:
        json.loads((p / "config.json").read_text())
        config = AutoConfig.from_pretrained(p)
    except (ValueError, KeyError, json.JSONDecodeError) as e:
        raise ValueError(f"broken config.json in {str(p)!r}: {e}") from e
    wrapper = _wrapper(getattr(config, "architectures", None))
    if wrapper is None:
        return config
    text = config.get_text_config()
    for key in _TOP_LEVEL_TOKENS:
        if getattr(config, key, None) is not None:
            setattr(text, key, getattr(config, key))
    text.architectures, text.served_text_of = [TEXT_MODEL_OF[wrapper]], wrapper
    return text
