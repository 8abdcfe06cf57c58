"""Rotary position embedding (rotate-half / NeoX layout, as Hugging Face Llama), over the
first `rotary_dim` dims of a head (all of them unless the config sets a partial rotary factor).

The frequencies and the attention factor come from transformers' own ROPE_INIT_FUNCTIONS for
every scaled kind (linear, dynamic, yarn, longrope / su, llama3), on its 4.x (`rope_scaling`) and
5.x (`rope_parameters`) config layouts. cos|sin rows are precomputed once per model, times the
attention factor as transformers multiplies them (one table shared by every layer); the `triton`
backend rotates inside its fused RoPE + KV-write kernel from the rows `lookup` names.

Two kinds change their frequencies with the sequence length, as transformers does per forward
call (`max(position_ids) + 1`): a token's length is ``max(prompt length, position + 1)``,
which is exactly what a fresh transformers module sees when it prefills the prompt in one
call and then decodes one token a call. transformers' Phi-3 generate also drops its cache when
a sequence first grows past longrope's threshold and recomputes it all with the long factors:
the scheduler restarts such a request there (`rope_restart_length`), its length from then on
the whole sequence's.

    longrope  short factors up to `threshold` (original_max_position_embeddings), long beyond:
              the table holds both halves, [short rows | long rows], and a token reads the long
              half once its length passes the threshold
    dynamic   NTK frequencies of the length itself past max_position_embeddings: one frequency
              row per length, and each step's cos|sin computed from them on the device

So a token's rotation depends on its request's RoPE length (the prompt's, or the sequence's
after a restart), not on its position alone: the scheduler salts such a request's prefix-cache
hashes by `length_class` (a block computed for one class is wrong for another), and each token
carries that length (`AttentionMetadata.rope_lengths`), so a batch or a CUDA graph mixes
lengths freely.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "su", "llama3")
LENGTH_DEPENDENT = ("dynamic", "longrope")


def rope_parameters(hf_config) -> tuple[float, dict | None]:
    """(theta, scaling) across transformers 4.x (rope_theta/rope_scaling) and 5.x (rope_parameters)."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    scaling = params if params.get("rope_type", "default") != "default" else getattr(hf_config, "rope_scaling", None)
    if scaling and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    return float(theta), scaling


def rope_type(hf_config) -> str:
    """The config's RoPE kind ('su' is longrope's old name); an unsupported one is refused."""
    _, scaling = rope_parameters(hf_config)
    kind = "default" if scaling is None else scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope scaling type {kind!r} in config.json (rope_scaling / rope_parameters); "
                         f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    return "longrope" if kind == "su" else kind


def rope_threshold(hf_config) -> int:
    """The length past which a length-dependent kind changes its frequencies (0: it never does)."""
    kind = rope_type(hf_config)
    if kind == "dynamic":  # transformers' module starts from max_position_embeddings (original_max_seq_len)
        return int(hf_config.max_position_embeddings)
    if kind == "longrope":
        _, scaling = rope_parameters(hf_config)
        return int(scaling.get("original_max_position_embeddings")
                   or getattr(hf_config, "original_max_position_embeddings", None) or hf_config.max_position_embeddings)
    return 0


def rope_context_limit(hf_config) -> int:
    """The longest sequence the config's RoPE is made for, as vLLM derives it: max_position_embeddings,
    times the factor of linear and dynamic scaling, and original_max_position_embeddings x factor
    for yarn (llama3 and longrope configs give the extended length as max_position_embeddings)."""
    limit = getattr(hf_config, "max_position_embeddings", None) or 2048
    kind = rope_type(hf_config)
    if kind in ("linear", "dynamic", "yarn"):
        _, scaling = rope_parameters(hf_config)
        factor = float(scaling.get("factor", 1.0))
        if kind == "yarn":
            limit = scaling.get("original_max_position_embeddings") or limit
        limit = int(limit * factor)
    return limit


def rope_restart_length(hf_config) -> int:
    """longrope: the length at which a request is recomputed from its first token (0: never).
    transformers' Phi-3 generate drops its cache when a sequence first grows past the threshold,
    so every token of a longer sequence rotates by the long factors; dynamic keeps its cache."""
    return rope_threshold(hf_config) if rope_type(hf_config) == "longrope" else 0


def length_class(hf_config):
    """prompt length -> the class of requests whose tokens rotate alike (0: by position alone), or
    None when the config's RoPE never depends on the length. longrope: 1 past the threshold;
    dynamic: the prompt length itself past the threshold (its prompt rows use that length's
    frequencies)."""
    kind, threshold = rope_type(hf_config), rope_threshold(hf_config)
    if kind == "longrope":
        return lambda n: int(n > threshold)
    if kind == "dynamic":
        return lambda n: n if n > threshold else 0
    return None


@dataclass(slots=True)
class RopeFrequencies:
    """What a config's RoPE computes, before any table."""

    kind: str
    inv_freq: torch.Tensor  # [rotary_dim / 2]: short sequences' (every sequence's, for a kind without a length)
    scale: float = 1.0  # the attention factor, multiplied into cos and sin
    threshold: int = 0  # LENGTH_DEPENDENT kinds: sequences longer than this rotate differently
    # longrope: [rotary_dim / 2], the long factors'; dynamic: [limit - threshold, rotary_dim / 2], the row
    # of length threshold + 1 + i
    longer: torch.Tensor | None = None


def default_inv_freq(theta: float, rotary_dim: int) -> torch.Tensor:
    """float32 throughout, as transformers computes it: the reference tests compare tokens exactly."""
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))


def rope_frequencies(hf_config, head_dim: int, max_position: int) -> RopeFrequencies:
    """The config's frequencies through transformers' ROPE_INIT_FUNCTIONS (the default kind: our own,
    the same formula; transformers 5.x keeps it in each model class)."""
    kind = rope_type(hf_config)
    if kind == "default":
        theta, _ = rope_parameters(hf_config)
        factor = _partial_rotary_factor(hf_config)
        return RopeFrequencies(kind, default_inv_freq(theta, int(head_dim * factor)))
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)  # the runner builds a bf16 model; transformers computes these in float32
    try:
        return _scaled_frequencies(ROPE_INIT_FUNCTIONS[kind], kind, hf_config, max_position)
    finally:
        torch.set_default_dtype(prev)


def _scaled_frequencies(init, kind: str, hf_config, max_position: int) -> RopeFrequencies:
    inv_freq, scale = init(hf_config, "cpu")
    freqs = RopeFrequencies(kind, inv_freq.float(), float(scale), rope_threshold(hf_config))
    if kind == "longrope":  # transformers asks for the long factors with a length just past the threshold
        freqs.longer = init(hf_config, "cpu", seq_len=freqs.threshold + 1)[0].float()
    elif kind == "dynamic" and max_position > freqs.threshold:
        freqs.longer = _dynamic_rows(init, hf_config, freqs.threshold + 1, max_position)
    return freqs


def _partial_rotary_factor(hf_config) -> float:
    params = getattr(hf_config, "rope_parameters", None) or {}
    return float(params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None) or 1.0))


def _dynamic_rows(init, hf_config, first: int, last: int) -> torch.Tensor:
    """Dynamic NTK frequencies of every length first..last, each as transformers computes it in
    its forward: from a 0-d tensor length, one call each (a column of lengths broadcast through
    the same code rounds some rows differently; a call takes ~80 us, once at start-up)."""
    lengths = torch.arange(first, last + 1, device="cpu")  # (the model may be built under a CUDA device context)
    return torch.stack([init(hf_config, "cpu", seq_len=n)[0] for n in lengths]).float()


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, theta: float = 10000.0,
                 freqs: RopeFrequencies | None = None):
        super().__init__()
        freqs = freqs or RopeFrequencies("default", default_inv_freq(theta, head_dim))
        self.kind, self.scale, self.threshold = freqs.kind, freqs.scale, freqs.threshold
        self.rotary_dim = 2 * len(freqs.inv_freq)
        if self.rotary_dim > head_dim:
            raise ValueError(f"rotary dims {self.rotary_dim} exceed the head dim {head_dim}")
        self.max_position = max_position
        self.length_dependent = freqs.kind in LENGTH_DEPENDENT
        positions = torch.arange(max_position, dtype=torch.float32)  # on the device the model is built on
        inv_freq = freqs.inv_freq.to(positions.device)  # (transformers computes scaled ones on the CPU)
        longer = None if freqs.longer is None else freqs.longer.to(positions.device)
        table = self._rows(positions, inv_freq)
        if freqs.kind == "longrope":
            table = torch.cat([table, self._rows(positions, longer)])
        self.register_buffer("cos_sin", table, persistent=False)
        if freqs.kind == "dynamic":  # row i: lengths up to the threshold (i = 0), then threshold + i
            rows = [inv_freq[None]] + ([longer] if longer is not None else [])
            self.register_buffer("dynamic_inv_freq", torch.cat(rows), persistent=False)

    def _rows(self, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
        """[T, rotary_dim]: cos | sin of each position (float32) at `inv_freq` ([rotary_dim / 2], or a
        row per token), times the attention factor, as transformers multiplies them."""
        freqs = positions[:, None] * inv_freq
        return torch.cat([freqs.cos() * self.scale, freqs.sin() * self.scale], dim=-1)

    def lookup(self, positions: torch.Tensor, rope_lengths: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(table, rows): token t rotates by table[rows[t]]. `rope_lengths` [T]: each token's
        request's RoPE length (needed only when `length_dependent`)."""
        if not self.length_dependent:
            return self.cos_sin, positions
        if rope_lengths is None:
            raise ValueError(f"{self.kind} RoPE needs each token's RoPE length (AttentionMetadata.rope_lengths)")
        length = torch.maximum(rope_lengths, positions + 1)
        if self.kind == "longrope":
            return self.cos_sin, positions + self.max_position * (length > self.threshold)
        row = (length - self.threshold).clamp(0, self.dynamic_inv_freq.shape[0] - 1)
        return self._rows(positions.float(), self.dynamic_inv_freq[row]), torch.arange(len(positions),
                                                                                       device=positions.device)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                rope_lengths: torch.Tensor | None = None):
        """q: [T, Hq, D], k: [T, Hk, D] -> rotated q, k (the first rotary_dim dims of each head)."""
        table, rows = self.lookup(positions, rope_lengths)
        cos, sin = table[rows].unsqueeze(1).chunk(2, dim=-1)
        return _rotate(q, cos, sin, self.rotary_dim), _rotate(k, cos, sin, self.rotary_dim)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    x1, x2 = rot.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest.float()], dim=-1).to(x.dtype)
