"""The Llama family: Llama, Mistral, Ministral, Qwen2 (qkv bias), Qwen3 (per-head q/k RMSNorm),
Phi-3 (fused checkpoint projections, partial rotary, LongRoPE); the mixtures of experts
(models/moe.py) are this model with a sparse MoE block as the MLP.

The model sees flattened token ids, their positions, and one AttentionMetadata per
step. q/k/v and gate/up projections are merged into one matmul each; the weight
loader maps Hugging Face names onto the merged parameters shard by shard (a checkpoint
that ships them fused, as Phi-3's qkv_proj and gate_up_proj, is cut into those shards first).
"""

from __future__ import annotations

import math
import re

import torch
import torch.nn.functional as F
from torch import nn

from expresslane.attention.backend import AttentionBackend, AttentionMetadata
from expresslane.distributed.group import TPGroup
from expresslane.distributed.layers import (ColumnParallelLinear, ParallelLMHead, RowParallelLinear,
                                            VocabParallelEmbedding, even_split, gather_logits, head_split)
from expresslane.layers.activation import silu_and_mul
from expresslane.layers.lora import LoRAState
from expresslane.layers.moe import SparseMoE
from expresslane.layers.norm import RMSNorm
from expresslane.layers.rotary import RotaryEmbedding, rope_context_limit, rope_frequencies
from expresslane.quant import QuantConfig, QuantLinear
from expresslane.quant.fp8 import takes_fp8_input


def _linear(in_features: int, shard_sizes: list[int], bias: bool, quant: QuantConfig | None,
            hf_modules: list[str]) -> nn.Module:
    """A (merged) projection: quantized when the model is and the checkpoint does not skip it."""
    if quant is not None and quant.quantizes(hf_modules):
        return QuantLinear(in_features, shard_sizes, bias, quant.method)
    return nn.Linear(in_features, sum(shard_sizes), bias=bias)


class Attention(nn.Module):
    sliding_window: int | None = None  # a query at position p sees keys in (p - window, p]; None: all before it
    softcap: float | None = None  # Gemma 2's attention-logit cap (softcap * tanh(s / softcap)); None: none

    def __init__(self, cfg, backend: AttentionBackend, rotary: RotaryEmbedding, qkv_bias: bool, qk_norm: bool,
                 quant: QuantConfig | None, prefix: str, tp: TPGroup, window: int | None = None):
        super().__init__()
        self.sliding_window = window
        self.register_parameter("sinks", None)  # gpt-oss's: [heads], a logit each in the softmax's denominator
        heads = cfg.num_attention_heads
        kv_heads = cfg.num_key_value_heads or heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        # this rank's heads (all of them without tensor parallelism)
        self.num_heads, q_first, self.num_kv_heads, kv_first = head_split(heads, kv_heads, tp)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        o_bias = bool(getattr(cfg, "attention_bias", False))
        if tp.size == 1:
            self.qkv_proj = _linear(cfg.hidden_size, [self.q_size, self.kv_size, self.kv_size], qkv_bias or o_bias,
                                    quant, [f"{prefix}.{p}_proj" for p in "qkv"])
            self.o_proj = _linear(self.q_size, [cfg.hidden_size], o_bias, quant, [f"{prefix}.o_proj"])
        else:
            d = self.head_dim
            kv = (kv_first * d, self.kv_size)
            self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, [(q_first * d, self.q_size), kv, kv],
                                                 qkv_bias or o_bias)
            self.o_proj = RowParallelLinear(heads * d, cfg.hidden_size, o_bias, tp)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, backend.fused_ops) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, backend.fused_ops) if qk_norm else None
        self.rotary = rotary  # shared: one cos/sin table per model
        self.backend = backend
        self.kv_cache: torch.Tensor | None = None  # bound by the runner after allocation
        self.kv_group = 0  # whose slot mapping and block tables it reads (attention/kv_groups.py)
        self.kv_scales = (1.0, 1.0)  # k, v: an FP8 cache stores k / k_scale (checkpoint k_scale/v_scale)

    def forward(self, positions, x, meta: AttentionMetadata):
        return self.o_proj(self.attention(positions, self.qkv_proj(x), meta))

    def attention(self, positions, qkv, meta: AttentionMetadata):
        """RoPE, the KV write and attention of the projected q|k|v [T, q + 2 kv] -> [T, q]."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        qk_norm = None if self.q_norm is None else (self.q_norm, self.k_norm)  # the backend applies them
        meta = meta.group(self.kv_group)
        q = self.backend.store(positions, q, k, v, self.rotary, self.kv_cache, meta, self.kv_scales, qk_norm)
        return self.backend.attend(q, self.kv_cache, meta, self.scale, self.kv_scales, self.softcap,
                                   window=self.sliding_window, sinks=self.sinks).flatten(1)


class MLP(nn.Module):
    def __init__(self, cfg, quant: QuantConfig | None, prefix: str, tp: TPGroup, fused: bool):
        super().__init__()
        self.fused = fused
        bias = bool(getattr(cfg, "mlp_bias", False))
        inter = cfg.intermediate_size
        if tp.size == 1:
            self.gate_up_proj = _linear(cfg.hidden_size, [inter, inter], bias, quant,
                                        [f"{prefix}.gate_proj", f"{prefix}.up_proj"])
            self.down_proj = _linear(inter, [cfg.hidden_size], bias, quant, [f"{prefix}.down_proj"])
        else:
            mine = even_split(inter, tp, "intermediate size")
            self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, [mine, mine], bias)
            self.down_proj = RowParallelLinear(inter, cfg.hidden_size, bias, tp)
        self.fp8_act = fused and takes_fp8_input(self.down_proj)  # the SiLU kernel quantizes down_proj's input

    def forward(self, x):
        return self.down_proj(silu_and_mul(self.gate_up_proj(x), self.fused, self.fp8_act))


class DecoderLayer(nn.Module):
    attention_cls = Attention

    def __init__(self, cfg, backend: AttentionBackend, rotary: RotaryEmbedding, qkv_bias: bool, qk_norm: bool,
                 quant: QuantConfig | None, prefix: str, tp: TPGroup, mlp: nn.Module, window: int | None = None):
        super().__init__()
        fused = backend.fused_ops
        self.self_attn = self.attention_cls(cfg, backend, rotary, qkv_bias, qk_norm, quant, f"{prefix}.self_attn", tp,
                                            window)
        self.mlp = mlp
        self.sparse = isinstance(mlp, SparseMoE)
        # an FP8 projection after a fused norm gets its input quantized by the norm's kernel
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, fused,
                                       fused and takes_fp8_input(self.self_attn.qkv_proj))
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, fused,
                                                fused and takes_fp8_input(getattr(mlp, "gate_up_proj", None)))
        self.fused_rows = 0  # most rows of a fused decode step: fold_norms() sets it (0: off)

    def fused_decode_refusal(self) -> str | None:
        """Why this layer cannot run the fused decode path (None: it can)."""
        if self.sparse or not isinstance(self.mlp, MLP):
            return "a mixture-of-experts layer"
        attn, mlp = self.self_attn, self.mlp
        if any(type(p) is not nn.Linear for p in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)):
            return "quantized or tensor-parallel projections"
        return None

    def fold_norms(self) -> None:
        """The fused decode layout: each norm's weight g multiplied into the columns of the
        projection it feeds (in place, W[:, k] *= g[k]) and set to ones, so the unfused path
        (prefill) computes the same function with the plain norm."""
        if why := self.fused_decode_refusal():
            raise ValueError(f"the fused decode layer cannot run {why}")
        if self.fused_rows:
            raise ValueError("the norms are folded already")
        for norm, proj in ((self.input_layernorm, self.self_attn.qkv_proj),
                           (self.post_attention_layernorm, self.mlp.gate_up_proj)):
            proj.weight.data.mul_(norm.weight.data.to(proj.weight.dtype))
            norm.weight.data.fill_(1.0)
        from expresslane.layers.fused_gemv import MAX_ROWS  # (Triton only for this path)
        self.fused_rows = MAX_ROWS

    def forward(self, positions, x, residual, meta):
        """(hidden, residual) in and out. The fused decode path (every token a decode, at most
        fused_rows of them) returns the residual stream itself as hidden, and None as residual."""
        if meta.num_decodes == x.shape[0] <= self.fused_rows:
            return self._fused_decode(positions, x if residual is None else x + residual, meta), None
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        if self.sparse:  # it counts tokens per expert: the real ones (CUDA-graph padding has slot -1)
            return self.mlp(x, meta.slot_mapping), residual
        return self.mlp(x), residual

    def _fused_decode(self, positions, h, meta):
        """Six launches: QKV (+ input norm), RoPE + KV write, attention, o_proj (+ residual),
        gate|up (+ post-attention norm), down (+ SiLU-and-mul, + residual); h is the residual
        stream (the sum transformers calls hidden_states), in and out."""
        from expresslane.layers.fused_gemv import fused_gemv

        attn, mlp = self.self_attn, self.mlp
        qkv = fused_gemv(h, attn.qkv_proj.weight, attn.qkv_proj.bias, norm_eps=self.input_layernorm.eps)
        h = fused_gemv(attn.attention(positions, qkv, meta), attn.o_proj.weight, attn.o_proj.bias, residual=h)
        gate_up = fused_gemv(h, mlp.gate_up_proj.weight, mlp.gate_up_proj.bias,
                             norm_eps=self.post_attention_layernorm.eps)
        return fused_gemv(gate_up, mlp.down_proj.weight, mlp.down_proj.bias, silu=True, residual=h)


class LlamaForCausalLM(nn.Module):
    qkv_bias = False
    qk_norm = False
    has_lm_head = True  # a base-model checkpoint (`*Model`, embeddings) has none: logits use the embeddings
    # which layers slide over `sliding_window` as transformers' class of the family reads the config:
    # "none" (Llama ignores it), "all" (Mistral, Mixtral, Qwen3-MoE), "layer_types" (Ministral, Qwen2,
    # Qwen3: the layers typed "sliding_attention"; Qwen's from `use_sliding_window`, `max_window_layers`)
    window_layers = "none"
    fp8_kv_cache = True  # an FP8 KV cache (kv_cache_dtype fp8) is supported
    supports_lora = True  # LoRA adapters attach to its projections (models/lora_adapter.py)
    backend_attention = True  # its layers attend through the backend's store/attend (MLA: attention/mla.py)

    @classmethod
    def attention_windows(cls, cfg) -> list[int | None]:
        """Each layer's sliding window in tokens (None: global attention)."""
        n = cfg.num_hidden_layers
        window = getattr(cfg, "sliding_window", None)
        if cls.window_layers == "none" or not window or getattr(cfg, "use_sliding_window", True) is False:
            return [None] * n
        if not isinstance(window, int) or window < 1:
            raise ValueError(f"config.json: sliding_window must be a positive integer, got {window!r}")
        if cls.window_layers == "all":
            return [window] * n
        first = getattr(cfg, "max_window_layers", 0) or 0  # (configs written before `layer_types`)
        types = getattr(cfg, "layer_types", None) or ["sliding_attention" if i >= first else "full_attention"
                                                      for i in range(n)]
        if len(types) != n:
            raise ValueError(f"config.json: layer_types has {len(types)} entries for {n} layers")
        return [window if t == "sliding_attention" else None for t in types]

    def __init__(self, cfg, backend: AttentionBackend, quant: QuantConfig | None = None, tp: TPGroup | None = None):
        """`tp`: the tensor-parallel group this rank's slice of the model is built for."""
        super().__init__()
        self.config = cfg
        self.tp = tp = tp or TPGroup.single()
        if tp.size > 1 and quant is not None:
            raise ValueError(f"tensor parallelism with quantized weights ({quant.name}) is not supported yet; "
                             "use tensor_parallel_size=1 or an unquantized checkpoint")
        sharded = tp.size > 1
        self.embed_tokens = self.make_embedding(cfg, tp)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.rotary = self.make_rotary(cfg, head_dim)
        self.windows = self.attention_windows(cfg)
        self.layers = nn.ModuleList(self.make_layer(cfg, i, backend, quant, tp) for i in range(cfg.num_hidden_layers))
        self.norm = self.make_norm(cfg, backend.fused_ops)
        self.tie_word_embeddings = not self.has_lm_head or bool(getattr(cfg, "tie_word_embeddings", False))
        head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp) if sharded else nn.Linear(
            cfg.hidden_size, cfg.vocab_size, bias=False)
        self.lm_head = None if self.tie_word_embeddings else head
        self.lora_state: LoRAState | None = None  # set when adapters are attached (models/lora_adapter.py)

    # -- the family's parts (Gemma overrides them: gemma.py) ----------------------------------
    def make_embedding(self, cfg, tp: TPGroup) -> nn.Module:
        if tp.size > 1:
            return VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        return nn.Embedding(cfg.vocab_size, cfg.hidden_size)

    def make_rotary(self, cfg, head_dim: int) -> RotaryEmbedding:
        """The RoPE table the layers share."""
        limit = rope_context_limit(cfg)
        return RotaryEmbedding(head_dim, limit, freqs=rope_frequencies(cfg, head_dim, limit))

    def make_layer(self, cfg, index: int, backend: AttentionBackend, quant: QuantConfig | None,
                   tp: TPGroup) -> nn.Module:
        prefix = f"model.layers.{index}"
        qkv_bias = self.qkv_bias or bool(getattr(cfg, "attention_bias", False))
        return DecoderLayer(cfg, backend, self.rotary, qkv_bias, self.qk_norm, quant, prefix, tp,
                            self.make_mlp(cfg, index, quant, f"{prefix}.mlp", tp, backend.fused_ops),
                            self.windows[index])

    def make_norm(self, cfg, fused: bool) -> nn.Module:
        return RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, fused)

    def make_mlp(self, cfg, index: int, quant: QuantConfig | None, prefix: str, tp: TPGroup,
                 fused: bool) -> nn.Module:
        """Layer `index`'s feed-forward block (the MoE models put a SparseMoE on some or all)."""
        return MLP(cfg, quant, prefix, tp, fused)

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """One layer's KV-cache tensor: k and v of this rank's KV heads, per slot."""
        attn = self.layers[0].self_attn
        return 2, num_blocks, block_size, attn.num_kv_heads, attn.head_dim

    def full_kv_values(self) -> int:
        """Values a token and layer would take as full K and V (the same as the cache holds here)."""
        return math.prod(self.kv_cache_shape(1, 1))

    def forward(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        x, residual = self.run_layers(positions, self.embed_tokens(input_ids), None, meta, 0, len(self.layers))
        return self.final_norm(x, residual)

    def run_layers(self, positions, x, residual, meta: AttentionMetadata, start: int, end: int):
        """Layers [start, end): (hidden, residual) in and out; residual is None before layer 0."""
        for layer in self.layers[start:end]:
            x, residual = layer(positions, x, residual, meta)
        return x, residual

    def final_norm(self, x, residual) -> torch.Tensor:
        return self.norm(x) if residual is None else self.norm(x, residual)[0]

    def fused_decode_refusal(self) -> str | None:
        """Why the fused decode layer cannot run on this model (None: it can)."""
        if self.tp.size > 1:
            return "tensor parallelism"
        return next(filter(None, (layer.fused_decode_refusal() for layer in self.layers)), None)

    def enable_fused_decode(self) -> None:
        """Turn on the fused decode layer (``fused_decode_layer``), once, after loading: every
        layer's norm weights folded into its QKV and gate|up weights."""
        if why := self.fused_decode_refusal():
            raise ValueError(f"the fused decode layer cannot run {why}")
        for layer in self.layers:
            layer.fold_norms()

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """float32 logits; into `out` when given (a CUDA graph's static output)."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = F.linear(hidden, weight)
        if self.tp.size > 1:
            logits = gather_logits(logits, self.config.vocab_size, self.tp)
        return logits.float() if out is None else out.copy_(logits)

    # -- weights ---------------------------------------------------------------------------
    def load_weights(self, weights) -> None:
        """`weights`: iterable of (Hugging Face name, tensor). Every parameter must be set."""
        params = dict(self.named_parameters())
        quantized = {n: m for n, m in self.named_modules() if isinstance(m, QuantLinear)}
        moe = {n: m for n, m in self.named_modules() if isinstance(m, SparseMoE)}
        loaded: set[str] = set()
        for hf_name, tensor in self._unfused(weights):
            if "rotary_emb.inv_freq" in hf_name or (self.tie_word_embeddings and hf_name == "lm_head.weight"):
                continue
            if expert := _EXPERT.search(hf_name):  # one expert's projection: its SparseMoE stacks them
                layer, index, proj, part = expert.groups()
                block = moe.get(f"layers.{layer}.mlp")
                if block is None:
                    raise ValueError(f"checkpoint tensor {hf_name!r}: layer {layer} of {type(self).__name__} "
                                     "has no experts")
                key = block.load_expert(int(index), _EXPERT_PARTS[proj], part, tensor)
                if key is not None:  # None: an expert another rank holds
                    loaded.add(f"layers.{layer}.mlp#{key}")
                continue
            name, shard = self._map_name(hf_name)
            module, _, part = name.rpartition(".")
            if part in ("k_scale", "v_scale") and module.endswith("self_attn"):  # FP8 KV-cache scales
                attn = self.get_submodule(module)
                k_scale, v_scale = attn.kv_scales
                attn.kv_scales = (float(tensor), v_scale) if part == "k_scale" else (k_scale, float(tensor))
                continue
            if module in quantized and part != "bias":  # the method builds its own weights
                quantized[module].load_part({None: 0, "q": 0, "k": 1, "v": 2}.get(shard, shard), part, tensor)
                continue
            if name not in params:
                raise ValueError(f"checkpoint tensor {hf_name!r} matches no parameter of {type(self).__name__}")
            owner = self.get_submodule(module)
            if hasattr(owner, "load"):  # a tensor-parallel layer: it cuts out its own slice
                owner.load(part, tensor, {None: None, "q": 0, "k": 1, "v": 2}.get(shard, shard))
            else:
                _copy_shard(params[name], tensor, shard, self)
            loaded.add(name if shard is None else f"{name}#{shard}")
        expected = {n for n in params if not n.endswith(("qkv_proj.weight", "qkv_proj.bias", "gate_up_proj.weight",
                                                          "gate_up_proj.bias"))
                    and n.rpartition(".")[0] not in moe  # a SparseMoE's stacked experts: by expert below
                    and n.rsplit(".", 2)[0] not in moe}  # (INT4 experts: w13.qweight, ...)
        expected |= {f"{n}#{key}" for n, m in moe.items() for key in m.expected_keys()}
        expected |= {f"{n}#{s}" for n in params if "qkv_proj" in n for s in "qkv"}
        expected |= {f"{n}#{s}" for n in params if "gate_up_proj" in n for s in (0, 1)}
        missing = sorted(expected - loaded) + sorted(f"{n}{p}" for n, m in quantized.items() for p in m.missing())
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")

    def _unfused(self, weights):
        """(name, tensor) as the loader expects them: a fused checkpoint projection (Phi-3's
        self_attn.qkv_proj, mlp.gate_up_proj) cut into its q/k/v or gate/up tensors."""
        cfg = self.config
        d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        q, kv = cfg.num_attention_heads * d, (cfg.num_key_value_heads or cfg.num_attention_heads) * d
        for name, tensor in weights:
            fused = _FUSED.search(name)
            if fused is None:
                yield name, tensor
                continue
            proj, part = fused.groups()
            if part not in ("weight", "bias"):
                raise ValueError(f"checkpoint tensor {name!r}: a fused projection's {part!r} (a quantized "
                                 "checkpoint) is not supported; use an unquantized checkpoint")
            sizes, names = ([q, kv, kv], ("q_proj", "k_proj", "v_proj")) if proj == "qkv_proj" else (
                [cfg.intermediate_size] * 2, ("gate_proj", "up_proj"))
            if tensor.shape[0] != sum(sizes):
                raise ValueError(f"checkpoint tensor {name!r} has {tensor.shape[0]} rows; the config gives "
                                 f"{' + '.join(map(str, sizes))}")
            for piece, new in zip(tensor.split(sizes), names):
                yield name.replace(f".{proj}.", f".{new}."), piece

    @staticmethod
    def _map_name(hf_name: str) -> tuple[str, object]:
        name = hf_name.removeprefix("model.").replace(".block_sparse_moe.", ".mlp.")  # Mixtral's router
        for part, shard in (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")):
            if f".{part}." in name:
                return name.replace(part, "qkv_proj"), shard
        for part, shard in (("gate_proj", 0), ("up_proj", 1)):
            if f".{part}." in name:
                return name.replace(part, "gate_up_proj"), shard
        return name, None


# a projection the checkpoint ships fused (Phi-3)
_FUSED = re.compile(r"layers\.\d+\.(?:self_attn|mlp)\.(qkv_proj|gate_up_proj)\.(\w+)$")
# one expert's projection, as Mixtral (w1 gate, w3 up, w2 down) and Qwen3-MoE name them
_EXPERT = re.compile(r"layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)"
                     r"\.(weight|bias|qweight|qzeros|scales|g_idx|blocks)$")
_EXPERT_PARTS = {"w1": "gate", "w3": "up", "w2": "down", "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}


def _copy_shard(param: nn.Parameter, tensor: torch.Tensor, shard, model: LlamaForCausalLM) -> None:
    if shard is None:
        target = param.data
    elif isinstance(shard, int):
        size = param.shape[0] // 2
        target = param.data[shard * size:(shard + 1) * size]
    else:
        attn = model.layers[0].self_attn
        offset = {"q": 0, "k": attn.q_size, "v": attn.q_size + attn.kv_size}[shard]
        size = attn.q_size if shard == "q" else attn.kv_size
        target = param.data[offset:offset + size]
    if target.shape != tensor.shape:
        raise ValueError(f"checkpoint tensor shape {tuple(tensor.shape)} does not fit {tuple(target.shape)}")
    target.copy_(tensor)


class MistralForCausalLM(LlamaForCausalLM):
    window_layers = "all"


class MinistralForCausalLM(LlamaForCausalLM):
    window_layers = "layer_types"


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True
    window_layers = "layer_types"


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
    window_layers = "layer_types"


def base_model(causal_lm: type[LlamaForCausalLM]) -> type[LlamaForCausalLM]:
    """`QwenXModel` from `QwenXForCausalLM`: the same layers, no LM head (served for embeddings)."""
    name = causal_lm.__name__.removesuffix("ForCausalLM") + "Model"
    return type(name, (causal_lm,), {"has_lm_head": False, "__module__": __name__})


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3, Phi-3.5 and Phi-4: Llama's computation; the checkpoint fuses qkv_proj and
    gate_up_proj (cut by the loader), partial rotary and LongRoPE come from the config."""
    window_layers = "all"  # transformers' Phi-3 applies `sliding_window` on every layer
