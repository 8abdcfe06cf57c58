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


def load_hf_config(path: str | Path):
    from transformers import AutoConfig

    p = check_model_dir(path)
    try:
        json.loads((p / "config.json").read_text())
        return AutoConfig.from_pretrained(p)
    except (ValueError, KeyError, json.JSONDecodeError) as e:
        raise ValueError(f"broken config.json in {str(p)!r}: {e}") from e
