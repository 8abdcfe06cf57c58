"""Quantized copies of the tests' tiny models, in each checkpoint format, and the float32
references they stand for. Nothing is downloaded."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from expresslane.models import quantize
from expresslane.quant import checkpoint
from expresslane.quant.fp8 import quantize_per_row
from expresslane.quant.int4 import gptq_tensors

GROUP = 32  # the tiny models have 64 or 128 inputs per layer


def quantize_dir(src: Path, dst: Path, fmt: str, *, desc_act: bool = False, group: int = GROUP) -> Path:
    """`src` (an unquantized HF directory) with its decoder projections (experts included) in
    format `fmt`: fp8 (compressed-tensors, per channel), awq and gptq as `expresslane quantize`
    writes them; fp8-tensor (HF "fp8", per-tensor scales), fp8-block (HF "fp8", 16 x 16 blocks)
    and gptq with desc_act (a random input order), which it does not write, here. The INT4 ones
    in groups of `group` inputs."""
    if fmt in ("fp8", "awq", "gptq") and not desc_act:
        return quantize.quantize_dir(src, dst, fmt, group_size=group)
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.is_file():
            shutil.copy(f, dst / f.name)
    tensors = {}
    gen = torch.Generator().manual_seed(0)
    perms: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        for name, t in load_file(f).items():
            if not checkpoint.is_quantized(name):
                tensors[name] = t
                continue
            prefix = name.removesuffix("weight")
            if fmt == "fp8-tensor":
                scale = t.float().abs().max() / 448.0
                parts = {"weight": (t.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn),
                         "weight_scale": scale.reshape(()), "input_scale": torch.tensor(1.0)}
            elif fmt == "fp8-block":
                n, k = t.shape
                blocks = t.float().reshape(n // 16, 16, k // 16, 16)
                scale = blocks.abs().amax((1, 3)) / 448.0
                q = (blocks / scale[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
                parts = {"weight": q.reshape(n, k), "weight_scale_inv": scale}
            elif fmt == "gptq":  # desc_act: projections of the same input share GPTQ's input order
                kind = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}.get(name.split(".")[-2])
                key = name.rsplit(".", 2)[0] + "." + (kind or name.split(".")[-2])
                perm = perms.setdefault(key, torch.randperm(t.shape[1], generator=gen))
                parts = gptq_tensors(t, group, perm=perm)
            else:
                raise ValueError(f"unknown test format {fmt!r}")
            tensors |= {prefix + suffix: v.contiguous() for suffix, v in parts.items()}
    save_file(tensors, str(dst / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    if fmt == "fp8-tensor":
        qc = {"quant_method": "fp8", "activation_scheme": "static"}
    elif fmt == "fp8-block":
        qc = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [16, 16]}
    else:
        qc = {**checkpoint.quantization_config(fmt, group), "desc_act": True}
    (dst / "config.json").write_text(json.dumps({**config, "quantization_config": qc}, indent=2))
    return dst


def fake_quant_rows(x: torch.Tensor) -> torch.Tensor:
    """Per-token e4m3 quantize-dequantize, in float32 (W8A8's activations)."""
    q, s = quantize_per_row(x.reshape(-1, x.shape[-1]))
    return (q.float() * s[:, None]).view(x.shape)


AWQ_SLOT = [0, 4, 1, 5, 2, 6, 3, 7]  # nibble holding column j of each 8 (AutoAWQ's pack order 0,2,4,6,1,3,5,7)


def _nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 [..., W] -> [..., W, 8]: nibble i of every word (bits 4i .. 4i+3)."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    return torch.stack([(w >> (4 * i)) & 0xF for i in range(8)], -1)


def reference_weight(parts: dict[str, torch.Tensor], fmt: str) -> torch.Tensor:
    """float32 [N, K] of one linear from its checkpoint tensors, from the formats' definitions
    written out independently of expresslane.quant (fmt "awq-128": AWQ with groups of 128
    inputs; else GROUP; GPTQ's groups come from its g_idx)."""
    fmt, _, group = fmt.partition("-")
    group = int(group) if group.isdigit() else GROUP
    if fmt.startswith("fp8"):
        w = parts["weight"].float()
        if "weight_scale_inv" in parts:  # block-wise
            s = parts["weight_scale_inv"].float()
            bn, bk = w.shape[0] // s.shape[0], w.shape[1] // s.shape[1]
            return w * s.repeat_interleave(bn, 0).repeat_interleave(bk, 1)
        s = parts["weight_scale"].float()
        return w * (s.reshape(-1, 1) if s.numel() > 1 else s)
    scales = parts["scales"].float()
    if fmt == "awq":  # qweight [K, N/8], column j of word c at nibble AWQ_SLOT[j]
        q = _nibbles(parts["qweight"])[:, :, AWQ_SLOT].flatten(1)
        z = _nibbles(parts["qzeros"])[:, :, AWQ_SLOT].flatten(1)
        g = torch.arange(q.shape[0]) // group
    else:  # qweight [K/8, N], input 8r + j at nibble j of row r; zeros stored minus one
        q = _nibbles(parts["qweight"].t()).flatten(1).t()
        z = _nibbles(parts["qzeros"]).flatten(1) + 1
        g = parts["g_idx"].long()
    return ((q - z[g]).float() * scales[g]).t()
