"""Which AttentionBackend a model gets: ``torch`` (the reference, CPU and GPU) or ``triton``."""

from __future__ import annotations

import os

import torch

from expresslane.attention.backend import AttentionBackend


def get_backend(name: str, num_heads: int, num_kv_heads: int, head_dim: int,
                device: torch.device, kv_dtype: torch.dtype = torch.bfloat16,
                prefill_library: str = "triton", softcap: float | None = None,
                window: int | None = None) -> AttentionBackend:
    """`kv_dtype`: the KV cache's element type (the Triton tiles' shared memory depends on it);
    `prefill_library`: who runs long prefill chunks in the triton backend (library_prefill.py);
    `softcap`: the model's attention-score cap (the library has none: "auto" keeps to the kernel);
    `window`: the sliding window every layer has (None: some layer sees every key)."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        if prefill_library == "cudnn":  # auto: the torch backend has one prefill path
            raise ValueError(f"prefill_attention {prefill_library!r} needs the triton attention backend (the torch "
                             "backend has one prefill path)")
        from expresslane.attention.torch_backend import TorchAttentionBackend
        return TorchAttentionBackend()
    if name == "triton":
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("attention_backend 'triton' needs a CUDA device (on CPU only through Triton's "
                             "interpreter, TRITON_INTERPRET=1, for tests); use 'torch' or 'auto'")
        if softcap is not None and prefill_library == "cudnn":
            raise ValueError("prefill_attention 'cudnn' cannot soft-cap attention scores (the model's "
                             "attn_logit_softcapping); use 'triton' or 'auto'")
        if softcap is not None:
            prefill_library = "triton"
        from expresslane.attention.triton_backend import TritonAttentionBackend
        return TritonAttentionBackend(num_heads, num_kv_heads, head_dim, device, kv_dtype=kv_dtype,
                                      prefill_library=prefill_library, window=window)
    raise ValueError(f"unknown attention backend {name!r} (available: torch, triton)")
