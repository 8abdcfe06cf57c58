"""Quantized checkpoints in the formats users have, from float weights (``make-model --quantization``,
and ``expresslane quantize`` of a model directory: models/quantize.py).

``plan`` gives each quantized linear's tensors (name suffix, dtype, shape) before any is
computed, so the writer can stream a safetensors file whose header comes first; ``tensors``
computes them from one float weight [N, K]. Only the decoder layers' projections are
quantized; the checkpoint's ``quantization_config`` says so as the formats do.
"""

from __future__ import annotations

import torch

from expresslane.quant.int4 import awq_tensors, gptq_tensors

FORMATS = ("fp8", "awq", "gptq")
GROUP_SIZE = 128
_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
            "w1", "w2", "w3")  # Mixtral's experts: gate, down, up


def is_quantized(name: str) -> bool:
    """Whether a checkpoint tensor (HF name) is a weight the formats quantize."""
    return name.startswith("model.layers.") and name.endswith(".weight") and name.split(".")[-2] in _LINEARS


def quantization_config(fmt: str, group_size: int = GROUP_SIZE) -> dict:
    if fmt == "fp8":  # compressed-tensors FP8 "dynamic": per-channel weights, per-token activations
        scheme = {"num_bits": 8, "type": "float", "symmetric": True}
        return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
                "config_groups": {"group_0": {
                    "targets": ["Linear"],
                    "weights": {**scheme, "strategy": "channel", "dynamic": False, "observer": "minmax"},
                    "input_activations": {**scheme, "strategy": "token", "dynamic": True, "observer": None}}},
                "ignore": ["lm_head"]}
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm",
                "modules_to_not_convert": None}
    if fmt == "gptq":
        return {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": False, "sym": True,
                "checkpoint_format": "gptq", "static_groups": False, "true_sequential": True, "damp_percent": 0.01}
    raise ValueError(f"unknown quantization format {fmt!r}; choose one of: {', '.join(FORMATS)}")


def plan(fmt: str, shape: tuple[int, int], dtype: torch.dtype,
         group_size: int = GROUP_SIZE) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """(suffix, dtype, shape) of the tensors that replace one weight of `shape` = (N, K)."""
    n, k = shape
    if fmt == "fp8":
        return [("weight", torch.float8_e4m3fn, (n, k)), ("weight_scale", dtype, (n, 1))]
    if k % group_size or n % 8:
        raise ValueError(f"{fmt}: a weight of shape {shape} does not split into groups of {group_size} inputs "
                         "and packs of 8 outputs")
    g = k // group_size
    if fmt == "awq":
        return [("qweight", torch.int32, (k, n // 8)), ("qzeros", torch.int32, (g, n // 8)),
                ("scales", torch.float16, (g, n))]
    return [("qweight", torch.int32, (k // 8, n)), ("qzeros", torch.int32, (g, n // 8)),
            ("scales", torch.float16, (g, n)), ("g_idx", torch.int32, (k,))]


def tensors(fmt: str, w: torch.Tensor, group_size: int = GROUP_SIZE, cpu: bool = True) -> dict[str, torch.Tensor]:
    """One float weight [N, K] -> its quantized tensors, in `plan`'s order (on the CPU, or on w's device)."""
    if fmt == "fp8":
        scale = (w.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 448.0).to(w.dtype)
        q = (w.float() / scale.float()).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
        out = {"weight": q, "weight_scale": scale}
    elif fmt == "awq":
        out = awq_tensors(w, group_size)
    else:
        out = gptq_tensors(w, group_size)
    return {name: t.cpu() for name, t in out.items()} if cpu else out

