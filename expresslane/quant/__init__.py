"""Quantization: a config that picks a method (from the checkpoint's ``quantization_config``
or ``--quantization``), and methods that own a linear layer's weights and matmul.

    method = resolve_quantization(hf_config, requested)   # None: unquantized
    layer = QuantLinear(in_features, shard_sizes, bias, method)  # when quantize(prefix)

Methods: ``fp8`` (W8A8, fp8.py), ``awq`` and ``gptq`` (W4A16, int4.py). Only the decoder
layers' linear projections are quantized; embeddings, norms and the LM head stay in the
model dtype (as in vLLM and in the checkpoints of these formats).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from expresslane.quant.fp8 import Fp8Method
from expresslane.quant.int4 import Int4Method
from expresslane.quant.linear import QuantLinear

QUANTIZATION_METHODS = ("fp8", "awq", "gptq", "compressed-tensors")

__all__ = ["QUANTIZATION_METHODS", "QuantConfig", "QuantLinear", "resolve_quantization"]


@dataclass(frozen=True, slots=True)
class QuantConfig:
    method: object  # Fp8Method | Int4Method
    ignore: tuple[str, ...] = field(default=())  # HF module names or "re:" patterns left unquantized

    @property
    def name(self) -> str:
        return self.method.name

    def quantizes(self, hf_modules: list[str]) -> bool:
        """Whether the linear layer made of these HF modules (e.g. q/k/v_proj) is quantized."""
        skipped = [m for m in hf_modules if self._ignored(m)]
        if skipped and len(skipped) != len(hf_modules):
            raise ValueError(f"the checkpoint leaves {skipped} unquantized but not the rest of {hf_modules}, "
                             "which expresslane merges into one layer")
        return not skipped

    def _ignored(self, module: str) -> bool:
        for pattern in self.ignore:
            if pattern.startswith("re:"):
                if re.fullmatch(pattern[3:], module):
                    return True
            elif module == pattern or module.endswith("." + pattern) or module.split(".")[-1] == pattern:
                return True
        return False


def _get(qc, key, default=None):
    return qc.get(key, default) if isinstance(qc, dict) else getattr(qc, key, default)


def _compressed_tensors(qc) -> Fp8Method:
    fmt = _get(qc, "format")
    groups = _get(qc, "config_groups") or {}
    if fmt != "float-quantized" or not groups:
        raise ValueError(f"compressed-tensors format {fmt!r} is not supported (supported: float-quantized FP8)")
    for name, group in groups.items():
        w = group.get("weights") or {}
        if w.get("type") != "float" or w.get("num_bits") != 8 or w.get("strategy") not in ("channel", "tensor"):
            raise ValueError(f"compressed-tensors group {name!r}: weights {w} are not FP8 per channel or per tensor")
    return Fp8Method(serialized=True)


def resolve_quantization(hf_config, requested: str | None) -> QuantConfig | None:
    """The method for a model: its checkpoint's quantization_config, or `requested` applied at load."""
    qc = _get(hf_config, "quantization_config")
    if requested not in (None, *QUANTIZATION_METHODS):
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)}, got {requested!r}")
    if qc is None:
        if requested is None:
            return None
        if requested != "fp8":
            raise ValueError(f"quantization={requested!r} needs a checkpoint in that format (its config.json has "
                             "no quantization_config); only fp8 quantizes an unquantized model at load. "
                             f"`expresslane make-model PRESET DIR --quantization {requested}` writes one")
        return QuantConfig(Fp8Method(serialized=False))
    kind = _get(qc, "quant_method")
    if requested is not None and requested != kind and (requested, kind) != ("fp8", "compressed-tensors"):
        raise ValueError(f"quantization={requested!r} asked for, but the checkpoint is quantized with {kind!r}")
    ignore = tuple(_get(qc, "ignore") or _get(qc, "modules_to_not_convert") or ())
    if kind == "mxfp4":  # gpt-oss's experts only: its loader dequantizes them (models/gpt_oss.py)
        return None
    if kind == "fp8":
        if _get(qc, "activation_scheme", "dynamic") not in ("dynamic", "static"):
            raise ValueError(f"fp8 activation_scheme {_get(qc, 'activation_scheme')!r} is not dynamic or static")
        return QuantConfig(Fp8Method(serialized=True, block_size=_get(qc, "weight_block_size")), ignore)
    if kind == "compressed-tensors":
        return QuantConfig(_compressed_tensors(qc), ignore)
    if kind in ("awq", "gptq"):
        bits = _get(qc, "bits", _get(qc, "w_bit"))
        group = _get(qc, "group_size", _get(qc, "q_group_size"))
        if bits != 4:
            raise ValueError(f"{kind} with {bits} bits is not supported (4 bits only)")
        if kind == "awq":
            if str(_get(qc, "version", "gemm")).lower() != "gemm" or not _get(qc, "zero_point", True):
                raise ValueError("awq: only version 'gemm' with zero points is supported")
            return QuantConfig(Int4Method("awq", group), ignore)
        fmt = _get(qc, "checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"gptq checkpoint_format {fmt!r} is not supported (gptq, gptq_v2)")
        return QuantConfig(Int4Method("gptq", group, zero_offset=1 if fmt == "gptq" else 0), ignore)
    raise ValueError(f"quantization method {kind!r} of the checkpoint is not supported "
                     f"(supported: {', '.join(QUANTIZATION_METHODS)})")
