"""``--generation-config``: sampling defaults from a model's ``generation_config.json``, as vLLM
applies them to requests that leave those fields unset."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# file key -> SamplingParams field (vLLM's list)
FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
          "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def sampling_defaults(choice: str, model_dir: Path | str) -> dict[str, Any]:
    """``choice``: ``auto`` (the model's file), ``vllm``/``none`` (no defaults), or a directory
    holding one. Missing keys are left out."""
    if choice in ("vllm", "none"):
        return {}
    folder = Path(model_dir if choice == "auto" else choice)
    path = folder / "generation_config.json"
    if not path.is_file():
        if choice != "auto":
            raise ValueError(f"--generation-config {choice!r}: no generation_config.json there")
        return {}
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"--generation-config: cannot read {path}: {e}") from None
    defaults = {name: config[key] for key, name in FIELDS.items() if config.get(key) is not None}
    if defaults:
        log.info("default sampling parameters from %s (requests that set them keep their own; "
                 "--generation-config vllm ignores them): %s", path, defaults)
    return defaults
