"""Model directories and their config.json, without torch: the API process reads them too
(it tokenizes and detokenizes; only the engine process loads weights)."""

from __future__ import annotations

import json
import os
import pathlib
from pathlib import Path

FORMAT_VERSION = 1  # of the directories make-model writes; part of the default model's cache path


def default_model_path() -> Path:
    """Where the built-in default model (the ``tiny`` preset) lives once built (presets.default_model_dir builds it)."""
    cache = pathlib.Path(os.environ.get("EXPRESSLANE_CACHE") or pathlib.Path.home() / ".cache" / "expresslane")
    return cache / f"tiny-seed0-v{FORMAT_VERSION}"


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
