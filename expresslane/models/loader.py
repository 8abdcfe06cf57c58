"""Model directory -> config and weights (Hugging Face layout, sharded safetensors)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [path / s for s in shards]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {str(path)!r} (random weights instead: load_format "
                                "'dummy', --load-format dummy)")
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"weight shards missing in {str(path)!r}: {missing}")
    return files


def iter_weights(path: Path, device: str | torch.device = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    for file in safetensors_files(path):
        try:
            with safe_open(str(file), framework="pt", device=str(device)) as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except Exception as e:  # safetensors raises its own error types for truncated files
            raise ValueError(f"cannot read weights from {str(file)!r}: {e}") from e
