"""INT4 weight-only (W4A16) from AWQ and GPTQ checkpoints: 4-bit weights in groups of
``group_size`` inputs, one scale and zero point per (group, output); ``w = (q - z) * s``.

Checkpoint layouts (one linear, K inputs, N outputs, G = group size)::

    AWQ  (quant_method "awq", version "gemm", AutoAWQ)
      qweight [K, N/8]   int32, packed along N: nibble i of word c holds output 8c + AWQ_ORDER[i]
      qzeros  [K/G, N/8] int32, packed the same way; z as stored
      scales  [K/G, N]   float16
    GPTQ (quant_method "gptq", AutoGPTQ / GPTQModel)
      qweight [K/8, N]   int32, packed along K: nibble j of row r holds input 8r + j
      qzeros  [K/G, N/8] int32, packed along N in order; "gptq" (v1) format stores z - 1,
                         "gptq_v2" stores z
      scales  [K/G, N]   float16
      g_idx   [K]        int32, group of each input (i // G, or a permutation's with desc_act)

Both become one layout at load, the kernel's: ``qweight [K/8, N]`` (GPTQ's packing),
``scales [K/G, N]`` as stored, ``zeros [K/G, N]`` uint8. With desc_act the
inputs are reordered so that groups are contiguous, and activations are gathered by the
same permutation at run time.
"""

from __future__ import annotations

import torch
from torch import nn

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ nibble i holds column AWQ_ORDER[i] of each 8
SEQ_ORDER = tuple(range(8))


GEMV_M = 3  # on CUDA: rows up to which the split-K GEMV runs (CUDA cores: each row costs its own arithmetic)
TILE_N, TILE_M = 16384, 512  # layers this wide keep the tile kernel up to this many rows


def _cuda_matmul(x: torch.Tensor, layer: nn.Module, n: int) -> torch.Tensor:
    """Decode sizes: the GEMV. Else, by what measured faster (benchmarks/gemv_bench.py):
    the fused Triton tile kernel for wide layers (many N tiles fill the GPU) up to TILE_M rows,
    otherwise dequantize (a 16-bit copy of the weight, written and read once per call) and one
    cuBLAS GEMM, which is as fast as bf16 itself for long prompts."""
    from expresslane.quant.gemv import int4_gemv
    from expresslane.quant.kernels import int4_dequantize, quant_gemm

    m = x.shape[0]
    if m <= GEMV_M:
        return int4_gemv(x, layer.qweight, layer.scales, layer.zeros, layer.bias, layer.group)
    if n >= TILE_N and m < TILE_M:
        return quant_gemm(x, layer.qweight, layer.scales, layer.zeros, layer.bias, n, layer.group)
    w = int4_dequantize(layer.qweight, layer.scales, layer.zeros, layer.group, x.dtype)
    return torch.addmm(layer.bias.to(x.dtype), x, w) if layer.bias is not None else x @ w


def _to_int32(x: torch.Tensor) -> torch.Tensor:
    """int64 holding 32-bit patterns -> int32 with the same bits."""
    return torch.where(x >= 2**31, x - 2**32, x).to(torch.int32)


def pack_cols(vals: torch.Tensor, order=SEQ_ORDER) -> torch.Tensor:
    """[R, C] ints in 0..15 -> [R, C/8] int32, nibble i of word c = column 8c + order[i]."""
    v = vals.to(torch.int64).view(vals.shape[0], -1, 8)
    packed = sum(v[:, :, order[i]] << (4 * i) for i in range(8))
    return _to_int32(packed)


def unpack_cols(packed: torch.Tensor, order=SEQ_ORDER) -> torch.Tensor:
    """Inverse of pack_cols: [R, C/8] int32 -> [R, C] int32 in 0..15."""
    shifts = torch.tensor([4 * order.index(j) for j in range(8)], dtype=torch.int32, device=packed.device)
    return ((packed[:, :, None] >> shifts) & 0xF).flatten(1)


def pack_rows(vals: torch.Tensor) -> torch.Tensor:
    """[R, C] ints in 0..15 -> [R/8, C] int32, nibble j of row r = row 8r + j."""
    return pack_cols(vals.t().contiguous()).t().contiguous()


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    return unpack_cols(packed.t().contiguous()).t().contiguous()


def quantize_groups(w: torch.Tensor, group: int, sym: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest 4-bit quantization of w [N, K] in groups of `group` inputs:
    (q [K, N] in 0..15, zeros [K/G, N] in 0..15, scales [K/G, N] float32)."""
    n, k = w.shape
    g = w.float().t().reshape(k // group, group, n)
    if sym:  # zero point 8, scale from the largest magnitude
        scale = (g.abs().amax(1) / 7).clamp(min=1e-8)
        zero = torch.full_like(scale, 8.0)
    else:
        lo, hi = g.amin(1).clamp(max=0), g.amax(1).clamp(min=0)
        scale = ((hi - lo) / 15).clamp(min=1e-8)
        zero = (-lo / scale).round().clamp(0, 15)
    q = (g / scale[:, None] + zero[:, None]).round().clamp(0, 15)
    return q.reshape(k, n).to(torch.int32), zero.to(torch.int32), scale


def awq_tensors(w: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
    """An AWQ (gemm) checkpoint's tensors for float weight w [N, K] (asymmetric)."""
    q, z, s = quantize_groups(w, group, sym=False)
    return {"qweight": pack_cols(q, AWQ_ORDER), "qzeros": pack_cols(z, AWQ_ORDER), "scales": s.half()}


def gptq_tensors(w: torch.Tensor, group: int, perm: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """A GPTQ (v1 format, sym) checkpoint's tensors for w [N, K]. With `perm` (desc_act), the
    i-th input in `perm` order belongs to group i // G; weights stay in input order."""
    n, k = w.shape
    order = perm if perm is not None else torch.arange(k)
    q_perm, z, s = quantize_groups(w[:, order], group, sym=True)
    q = torch.empty_like(q_perm)
    q[order] = q_perm
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[order] = torch.arange(k, dtype=torch.int32) // group
    return {"qweight": pack_rows(q), "qzeros": pack_cols(z - 1), "scales": s.half(), "g_idx": g_idx}


def dequantize(qweight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    """float32 [K, N] of the internal layout."""
    q = unpack_rows(qweight).float()
    g = torch.arange(q.shape[0], device=q.device) // group
    return (q - zeros[g].float()) * scales[g].float()


class Int4Method:
    """Owns a W4A16 linear's weights (``qweight``, ``scales``, ``zeros``, optional ``perm``)."""

    def __init__(self, fmt: str, group_size: int, zero_offset: int = 0):
        if fmt not in ("awq", "gptq"):
            raise ValueError(f"unknown INT4 format {fmt!r}")
        self.name = fmt
        self.group_size = group_size
        self.zero_offset = zero_offset  # added to stored GPTQ zeros (1 for the v1 format)
        self.required = ("qweight", "qzeros", "scales") + (("g_idx",) if fmt == "gptq" else ())
        self.ignored = ()

    def unpack(self, p: dict[str, torch.Tensor], k: int) -> tuple[torch.Tensor, ...]:
        """One shard's checkpoint tensors -> (q [K, n] ints, zeros [K/G, n] ints, scales [K/G, n], g_idx [K] or None)."""
        if self.name == "awq":
            q, z = unpack_cols(p["qweight"], AWQ_ORDER), unpack_cols(p["qzeros"], AWQ_ORDER)
            g_idx = None
        else:
            q, z = unpack_rows(p["qweight"]), unpack_cols(p["qzeros"]) + self.zero_offset
            g_idx = p["g_idx"].to(torch.int64)
        s = p["scales"]
        group = self.group_size if self.group_size > 0 else k
        if q.shape[0] != k or z.shape != s.shape or s.shape[0] != k // group or s.shape[1] != q.shape[1]:
            raise ValueError(f"{self.name} tensors do not fit a linear of {k} inputs in groups of {group}: "
                             f"qweight unpacks to {tuple(q.shape)}, zeros {tuple(z.shape)}, scales {tuple(s.shape)}")
        return q, z, s, g_idx

    def build(self, layer: nn.Module, shards: list[dict[str, torch.Tensor]]) -> None:
        k = layer.in_features
        group = self.group_size if self.group_size > 0 else k
        if k % group or group % 16:
            raise ValueError(f"{self.name}: {k} inputs do not split into groups of {group} (a multiple of 16)")
        qs, zs, ss, g_idxs = zip(*(self.unpack(p, k) for p in shards))
        q, z, s = torch.cat(qs, 1), torch.cat(zs, 1), torch.cat(ss, 1)
        perm = None
        if g_idxs[0] is not None:
            if any(not torch.equal(g, g_idxs[0]) for g in g_idxs[1:]):
                raise ValueError(f"{self.name}: the merged shards of one layer have different g_idx")
            g_idx = g_idxs[0].to(q.device)
            if not torch.equal(g_idx, torch.arange(k, device=q.device) // group):  # desc_act: sort inputs by group
                perm = torch.argsort(g_idx, stable=True)
                if not torch.equal(g_idx[perm], torch.arange(k, device=q.device) // group):
                    raise ValueError(f"{self.name}: g_idx does not give every group {group} inputs")
                q = q[perm]
        device = layer.device
        layer.qweight = nn.Parameter(pack_rows(q).to(device), requires_grad=False)
        layer.scales = nn.Parameter(s.to(device), requires_grad=False)  # checkpoint dtype: fp16 scales stay exact
        layer.zeros = nn.Parameter(z.to(device, torch.uint8), requires_grad=False)
        layer.perm = None if perm is None else nn.Parameter(perm.to(device), requires_grad=False)
        layer.group = group

    def shape(self, layer: nn.Module) -> tuple[int, int]:
        return layer.scales.shape[1], layer.qweight.shape[0] * 8

    def dequantized(self, layer: nn.Module) -> torch.Tensor:
        """float32 [N, K] in the checkpoint's input order."""
        w = dequantize(layer.qweight, layer.zeros, layer.scales, layer.group)
        if layer.perm is not None:
            w = w[torch.argsort(layer.perm)]
        return w.t()

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        if layer.perm is not None:
            x2 = x2[:, layer.perm]
        n = layer.scales.shape[1]
        if x.is_cuda:
            out = _cuda_matmul(x2.contiguous(), layer, n)
        else:  # the reference: dequantize, then a float32 matmul
            w = dequantize(layer.qweight, layer.zeros, layer.scales, layer.group)
            out = x2.float() @ w
            if layer.bias is not None:
                out = out + layer.bias.float()
            out = out.to(x.dtype)
        return out.view(*x.shape[:-1], n)
