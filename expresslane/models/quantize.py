"""``expresslane quantize``: a model directory copied with its weights in a quantized checkpoint
format (quant/checkpoint.py makes the tensors)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from expresslane.models.presets import MARKER_FILE
from expresslane.quant.checkpoint import (
    GROUP_SIZE,
    is_quantized,
    quantization_config,
    tensors,
)


def quantize_dir(src: str | Path, dst: str | Path, fmt: str, group_size: int = GROUP_SIZE) -> Path:
    """A copy of the model directory `src` at `dst` (new) with its decoder layers' projections
    quantized to `fmt`, each weight rounded to the nearest value of the format (no calibration
    data: not AWQ's or GPTQ's own search, their layout), and the format's `quantization_config`.
    The other tensors and files are copied as they are. Holds the weights in memory."""
    src, dst = Path(src), Path(dst)
    if dst.exists():
        raise ValueError(f"{dst} exists; quantize writes a new directory")
    config = json.loads((src / "config.json").read_text())
    if config.get("quantization_config"):
        raise ValueError(f"{src} is quantized already ({config['quantization_config'].get('quant_method')})")
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {src}")
    quantization_config(fmt, group_size)  # an unknown format fails before anything is written
    out: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(file, "pt") as f:
            for name in f.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                w = f.get_tensor(name)
                if is_quantized(name):
                    out.update({name.removesuffix("weight") + k: v.contiguous()
                                for k, v in tensors(fmt, w, group_size).items()})
                else:
                    out[name] = w
    partial = dst.with_name(dst.name + ".partial")  # renamed once complete: a failed run leaves no dst
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    for path in src.iterdir():  # tokenizer, generation config, chat template, ...
        if path.is_file() and path.suffix != ".safetensors" and path.name not in (
                "config.json", "model.safetensors.index.json", MARKER_FILE):
            shutil.copy2(path, partial / path.name)
    save_file(out, partial / "model.safetensors", metadata={"format": "pt"})
    config["quantization_config"] = quantization_config(fmt, group_size)
    (partial / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    partial.rename(dst)
    return dst
