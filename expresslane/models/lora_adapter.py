"""PEFT LoRA adapters: read from their directory (``adapter_config.json`` and
``adapter_model.safetensors``) and mapped onto the model's merged projections.

Our layers merge q|k|v and gate|up into one matmul each, so a per-projection adapter becomes
one *slice* of a merged layer: its A [r, in] reads the layer's input, its B [out, r] writes the
slice's output columns. A tensor is keyed (layer index, our module, slice index); B comes
with the adapter's scale folded in (lora_alpha / r, or / sqrt(r) with rslora).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from expresslane.layers.lora import LoRALinear, LoRAState
from expresslane.quant.fp8 import takes_fp8_input

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"

# a Hugging Face projection -> (our module in the decoder layer, its slice of that module)
TARGETS = {"q_proj": ("self_attn.qkv_proj", 0), "k_proj": ("self_attn.qkv_proj", 1),
           "v_proj": ("self_attn.qkv_proj", 2), "o_proj": ("self_attn.o_proj", 0),
           "gate_proj": ("mlp.gate_up_proj", 0), "up_proj": ("mlp.gate_up_proj", 1),
           "down_proj": ("mlp.down_proj", 0)}

_TENSOR = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+_proj)"
                     r"\.lora_([AB])(?:\.default)?\.weight$")

Key = tuple[int, str, int]  # (layer, module, slice)


class AdapterError(ValueError):
    """A LoRA adapter directory that cannot be served; the message names the file at fault."""


@dataclass(slots=True)
class LoRAAdapter:
    path: str
    rank: int  # the largest of its modules' ranks
    weights: dict[Key, tuple[torch.Tensor, torch.Tensor]]  # key -> (A [r, in], scale * B [out, r]), float32


def read_adapter(path: str | Path, max_rank: int) -> LoRAAdapter:
    """The adapter at `path`, checked: LoRA only, ranks up to `max_rank`, projections we serve."""
    from safetensors.torch import load_file

    root = Path(path)
    config_file, weights_file = root / ADAPTER_CONFIG, root / ADAPTER_WEIGHTS
    if not root.is_dir():
        raise AdapterError(f"LoRA adapter {str(root)!r}: no such directory")
    try:
        config = json.loads(config_file.read_text())
    except FileNotFoundError:
        raise AdapterError(f"LoRA adapter {str(root)!r}: {ADAPTER_CONFIG} is missing") from None
    except (OSError, ValueError) as e:
        raise AdapterError(f"LoRA adapter {str(config_file)!r}: cannot read it ({e})") from None
    if not isinstance(config, dict):
        raise AdapterError(f"LoRA adapter {str(config_file)!r}: expected a JSON object")
    _check_config(config, config_file)
    if not weights_file.is_file():
        raise AdapterError(f"LoRA adapter {str(root)!r}: {ADAPTER_WEIGHTS} is missing (the .bin format is not read)")
    try:
        tensors = load_file(weights_file, device="cpu")
    except Exception as e:  # a truncated or foreign file
        raise AdapterError(f"LoRA adapter {str(weights_file)!r}: cannot read it ({e})") from None
    pairs: dict[Key, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        m = _TENSOR.match(name)
        if m is None or m.group(2) not in TARGETS:
            raise AdapterError(f"LoRA adapter {str(weights_file)!r}: tensor {name!r} adapts a module that is not "
                               f"served (only {', '.join(TARGETS)} of the decoder layers)")
        module, part = TARGETS[m.group(2)]
        pairs.setdefault((int(m.group(1)), module, part), {})[m.group(3)] = (m.group(2), tensor)
    if not pairs:
        raise AdapterError(f"LoRA adapter {str(weights_file)!r}: holds no LoRA tensors")
    weights, rank = {}, 0
    for key, pair in sorted(pairs.items()):
        if set(pair) != {"A", "B"}:
            missing = "B" if "A" in pair else "A"
            raise AdapterError(f"LoRA adapter {str(weights_file)!r}: layer {key[0]} {next(iter(pair.values()))[0]} "
                               f"has no lora_{missing}")
        (proj, a), (_, b) = pair["A"], pair["B"]
        r = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != r:
            raise AdapterError(f"LoRA adapter {str(weights_file)!r}: layer {key[0]} {proj}: lora_A {tuple(a.shape)} "
                               f"and lora_B {tuple(b.shape)} do not pair")
        if r > max_rank:
            raise AdapterError(f"LoRA adapter {str(root)!r}: rank {r} is over max_lora_rank {max_rank}")
        weights[key] = (a.float().contiguous(), (b.float() * _scale(config, key[0], proj, r)).contiguous())
        rank = max(rank, r)
    return LoRAAdapter(str(root), rank, weights)


def _check_config(config: dict, config_file: Path) -> None:
    where = f"LoRA adapter {str(config_file)!r}"
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{where}: peft_type {config.get('peft_type')!r} is not LORA")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"{where}: bias {config['bias']!r} is not served (only 'none')")
    for name in ("use_dora", "fan_in_fan_out"):
        if config.get(name):
            raise AdapterError(f"{where}: {name} is not served")
    if config.get("modules_to_save"):
        raise AdapterError(f"{where}: modules_to_save ({config['modules_to_save']}) is not served")
    if not isinstance(config.get("lora_alpha", 8), (int, float)):
        raise AdapterError(f"{where}: lora_alpha must be a number")


def _pattern(patterns: dict | None, module_name: str):
    """PEFT's per-module override: the first pattern matching the module's name (suffix match)."""
    for pattern, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", module_name):
            return value
    return None


def _scale(config: dict, layer: int, proj: str, rank: int) -> float:
    """lora_alpha / r (rslora: / sqrt(r)); `alpha_pattern` may override alpha per module."""
    part = "self_attn" if proj in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
    alpha = _pattern(config.get("alpha_pattern"), f"model.layers.{layer}.{part}.{proj}")
    alpha = float(config.get("lora_alpha", 8) if alpha is None else alpha)
    return alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)


def attach_lora(model, state: LoRAState) -> dict[tuple[int, str], LoRALinear]:
    """Wrap every projection an adapter may target (the dense layers' MLPs, every layer's
    attention) in a LoRALinear sharing `state`; returns them by (layer, module). Called after
    the weights are loaded (the checkpoint's names stay those of the bare projections)."""
    from expresslane.distributed.layers import ColumnParallelLinear, RowParallelLinear
    from expresslane.models.llama import MLP

    cfg = model.config
    model.lora_state = state
    wrapped = {}
    for index, layer in enumerate(model.layers):
        attn = layer.self_attn
        q, kv, d = attn.q_size, attn.kv_size, attn.head_dim
        full_q, full_kv = cfg.num_attention_heads * d, (cfg.num_key_value_heads or cfg.num_attention_heads) * d
        # (owner, attribute, our name, this rank's slices, the full slices, the full input)
        owners = [(attn, "qkv_proj", "self_attn.qkv_proj", [(0, q), (q, kv), (q + kv, kv)],
                   [full_q, full_kv, full_kv], cfg.hidden_size),
                  (attn, "o_proj", "self_attn.o_proj", [(0, cfg.hidden_size)], [cfg.hidden_size], full_q)]
        if isinstance(layer.mlp, MLP):
            inter = layer.mlp.gate_up_proj.out_features // 2
            owners += [(layer.mlp, "gate_up_proj", "mlp.gate_up_proj", [(0, inter), (inter, inter)],
                        [cfg.intermediate_size] * 2, cfg.hidden_size),
                       (layer.mlp, "down_proj", "mlp.down_proj", [(0, cfg.hidden_size)], [cfg.hidden_size],
                        cfg.intermediate_size)]
        for owner, attr, name, slices, full_sizes, full_in in owners:
            base = getattr(owner, attr)
            if takes_fp8_input(base):
                raise ValueError("enable_lora: FP8-quantized projections are not served with adapters (yet)")
            b_rows = list(base.ranges) if isinstance(base, ColumnParallelLinear) else None
            a_cols = (base.in_start, base.in_features) if isinstance(base, RowParallelLinear) else None
            module = LoRALinear(base, slices, full_sizes, full_in, state, b_rows, a_cols)
            setattr(owner, attr, module)
            wrapped[index, name] = module
    state.allocate(list(wrapped.values()), next(model.parameters()).device)
    return wrapped


def check_fits(adapter: LoRAAdapter, modules: dict[tuple[int, str], LoRALinear]) -> None:
    """Every tensor of `adapter` has a wrapped projection of its shape (else AdapterError naming it)."""
    weights_file = str(Path(adapter.path) / ADAPTER_WEIGHTS)
    for (layer, name, part), (a, b) in adapter.weights.items():
        module = modules.get((layer, name))
        if module is None:
            raise AdapterError(f"LoRA adapter {weights_file!r}: layer {layer} {name} is not served (no such layer, or "
                               "a mixture-of-experts block)")
        size = module.full_sizes[part]
        if a.shape[1] != module.full_in or b.shape[0] != size:
            raise AdapterError(f"LoRA adapter {weights_file!r}: layer {layer} {name} slice {part}: lora_A "
                               f"{tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit the model ({module.full_in} "
                               f"in, {size} out)")
