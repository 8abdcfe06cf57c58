"""The fused MoE path (GPU, `triton` backend): routing, then the experts of a step in two
grouped GEMMs; four launches a layer (on one rank the sum over slots is the next RMSNorm's),
sizes fixed by the shape (no host sync: CUDA graphs capture it).

    route   per token: softmax, top-k, renormalisation, the per-expert counters (one kernel)
    align   the (token, slot) rows grouped by expert, each expert's run padded to BLOCK_M
            (one program: a histogram, a cumulative sum, atomic placement)
    GEMM 1  one launch over all experts: each BLOCK_M tile of rows belongs to one expert and
            multiplies its gate and up weights; SiLU(gate) * up (or gpt-oss's clamped SwiGLU,
            biases added first) is applied before the store
    GEMM 2  one launch: down projection, scaled by the routing weight, one row per (token, slot)
    sum     the k rows of each token (on one rank: by the next layer's fused RMSNorm)

Rows routed to expert -1 (expert parallelism: another rank's) are left out by the alignment
and their output rows stay zero. The kernels round where transformers does (the gate and up
projections, the SiLU, the product to the activation dtype).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from expresslane.quant.int4_experts import Int4Experts
from expresslane.quant.mxfp4 import Mxfp4Experts
from expresslane.triton_setup import rows_per_program, tl, triton


@triton.jit
def _weight_tile(w_ptr, s_ptr, z_ptr, expert, k0, k, k_ok, cols, cols_ok, stride_we, stride_wn, stride_se,
                 stride_sg, dtype: tl.constexpr, W4: tl.constexpr, GROUP: tl.constexpr):
    """[BLOCK_K, BLOCK_N]: W^T of `expert` at inputs k, outputs cols. Float W [E, N, K]; W4: the
    packed INT4 layout (qweight [E, K/8, N], scales and zeros [E, K/G, N]), dequantized here as
    (q - z) * s; one group per tile (GROUP is a multiple of BLOCK_K). (MXFP4: _mx4_tiles.)"""
    mask = k_ok[:, None] & cols_ok[None, :]
    if W4:
        packed = tl.load(w_ptr + expert * stride_we + (k // 8)[:, None] * stride_wn + cols[None, :], mask=mask,
                         other=0)
        q = (packed >> ((k % 8) * 4)[:, None]) & 0xF
        group = expert * stride_se + (k0 // GROUP) * stride_sg + cols
        z = tl.load(z_ptr + group, mask=cols_ok, other=0).to(tl.int32)
        scale = tl.load(s_ptr + group, mask=cols_ok, other=0.0).to(tl.float32)
        w = ((q - z[None, :]).to(tl.float32) * scale[None, :]).to(dtype)
    else:
        w = tl.load(w_ptr + expert * stride_we + cols[None, :].to(tl.int64) * stride_wn + k[:, None], mask=mask,
                    other=0.0)
    return w


@triton.jit
def _e2m1(code):
    """FP4 e2m1 codes (int32 nibbles) as float32 / 2^14: the three magnitude bits placed at an fp16's
    two low exponent bits and top mantissa bit (exponent 0 is then fp16's subnormal 0 or 2^-15,
    exact through the conversion), the sign at its sign bit."""
    bits = ((code & 7) << 9) | ((code & 8) << 12)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _mx4_scales(s_ptr, expert, k0, K, cols, cols_ok, stride_se, stride_sg, BLOCKS: tl.constexpr):
    """[BLOCK_N, BLOCKS] float32: the scales of the blocks of 32 inputs from k0 (scales [E, N, K/32],
    e8m0: 2^(s - 127)) times 2^14, the offset of _e2m1's values; s = 255 gives inf, as exp2 does."""
    g = k0 // 32 + tl.arange(0, BLOCKS)
    s = tl.load(s_ptr + expert * stride_se + cols[:, None].to(tl.int64) * stride_sg + g[None, :],
                mask=cols_ok[:, None] & (g < K // 32)[None, :], other=127).to(tl.int32) + 14
    return (tl.minimum(s, 255) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _mx4_load(w_ptr, s_ptr, expert, k0, K, cols, cols_ok, stride_we, stride_wn, stride_se, stride_sg,
              HALF_K: tl.constexpr):
    """MXFP4 W of `expert` at outputs cols, inputs [k0, k0 + 2 HALF_K): its bytes [BLOCK_N, HALF_K]
    (int32; blocks [E, N, K/2]: two e2m1 codes a byte, the even input low) and its blocks' scales
    (_mx4_scales), [BLOCK_N, HALF_K // 16, 1]. Each byte is read once, along K (the shipped layout's
    contiguous axis), a block's scale once."""
    kb = k0 // 2 + tl.arange(0, HALF_K)  # byte index along K
    packed = tl.load(w_ptr + expert * stride_we + cols[:, None].to(tl.int64) * stride_wn + kb[None, :],
                     mask=cols_ok[:, None] & (kb < K // 2)[None, :], other=0).to(tl.int32)
    return packed, _mx4_scales(s_ptr, expert, k0, K, cols, cols_ok, stride_se, stride_sg, HALF_K // 16)[:, :, None]


@triton.jit
def _mx4_tiles(w_ptr, s_ptr, expert, k0, K, cols, cols_ok, stride_we, stride_wn, stride_se, stride_sg,
               HALF_K: tl.constexpr, dtype: tl.constexpr):
    """MXFP4 W of `expert` at outputs cols, inputs [k0, k0 + 2 HALF_K), as two [BLOCK_N, HALF_K]
    tiles in `dtype`: the even inputs' and the odd inputs' (see _mx4_load); values made from bits."""
    BLOCK_N: tl.constexpr = cols.shape[0]
    packed, scale = _mx4_load(w_ptr, s_ptr, expert, k0, K, cols, cols_ok, stride_we, stride_wn, stride_se, stride_sg,
                              HALF_K)
    even = tl.reshape(tl.reshape(_e2m1(packed & 0xF), (BLOCK_N, HALF_K // 16, 16)) * scale, (BLOCK_N, HALF_K))
    odd = tl.reshape(tl.reshape(_e2m1(packed >> 4), (BLOCK_N, HALF_K // 16, 16)) * scale, (BLOCK_N, HALF_K))
    return even.to(dtype), odd.to(dtype)


@triton.jit
def _mx4_step(acc, a_even, a_odd, w_ptr, s_ptr, expert, k0, K, cols, cols_ok, stride_we, stride_wn, stride_se,
              stride_sg, HALF_K: tl.constexpr, dtype: tl.constexpr, PRECISION: tl.constexpr):
    """acc [BLOCK_M, BLOCK_N] += A [BLOCK_M, 2 HALF_K] . W^T for MXFP4 W at outputs cols, inputs k0..:
    a dot for the even inputs and one for the odd."""
    w_even, w_odd = _mx4_tiles(w_ptr, s_ptr, expert, k0, K, cols, cols_ok, stride_we, stride_wn, stride_se,
                               stride_sg, HALF_K, dtype)
    return tl.dot(a_odd, tl.trans(w_odd), tl.dot(a_even, tl.trans(w_even), acc, input_precision=PRECISION),
                  input_precision=PRECISION)


# Eight e2m1 codes of an int32 word as float32 (each / 2^14, _e2m1's) in PTX: the bytes j, j + 1
# spread to a word's halves (prmt), both halves' even codes, then their odd codes, put in place as
# fp16 bits at once (two shifts and masks each), the eight halves widened to float32.
_E2M1_WORD_PTX = tl.constexpr("""{
.reg .b32 z, y, t, e, o;
.reg .b16 l, h;
mov.b32 z, 0;
prmt.b32 y, $8, z, 0x4140;
shl.b32 e, y, 9; and.b32 e, e, 0x0E000E00; shl.b32 t, y, 12; and.b32 t, t, 0x80008000; or.b32 e, e, t;
shl.b32 o, y, 5; and.b32 o, o, 0x0E000E00; shl.b32 t, y, 8; and.b32 t, t, 0x80008000; or.b32 o, o, t;
mov.b32 {l, h}, e; cvt.f32.f16 $0, l; cvt.f32.f16 $2, h;
mov.b32 {l, h}, o; cvt.f32.f16 $1, l; cvt.f32.f16 $3, h;
prmt.b32 y, $8, z, 0x4342;
shl.b32 e, y, 9; and.b32 e, e, 0x0E000E00; shl.b32 t, y, 12; and.b32 t, t, 0x80008000; or.b32 e, e, t;
shl.b32 o, y, 5; and.b32 o, o, 0x0E000E00; shl.b32 t, y, 8; and.b32 t, t, 0x80008000; or.b32 o, o, t;
mov.b32 {l, h}, e; cvt.f32.f16 $4, l; cvt.f32.f16 $6, h;
mov.b32 {l, h}, o; cvt.f32.f16 $5, l; cvt.f32.f16 $7, h;
}""")


@triton.jit
def _e2m1_word(words):
    """The eight e2m1 codes of int32 words (byte j: code 2j low, 2j + 1 high) as eight float32
    tensors, code i's value / 2^14 in the i-th (_E2M1_WORD_PTX: CUDA only)."""
    return tl.inline_asm_elementwise(_E2M1_WORD_PTX, "=r,=r,=r,=r,=r,=r,=r,=r,r", [words],
                                     dtype=(tl.float32,) * 8, is_pure=True, pack=1)


@triton.jit
def _mx4_row_step(acc, a_row, a_ok, w_ptr, s_ptr, expert, k0, K, cols, cols_ok, stride_we, stride_wn, stride_se,
                  stride_sg, BLOCK_K: tl.constexpr, ASM: tl.constexpr):
    """One row of A times MXFP4 W at outputs cols, inputs [k0, k0 + BLOCK_K), in float32 without
    tensor cores (a tile of one row: no padding rows): acc [BLOCK_N, BLOCK_K // 8] += each int32
    word of codes' eight products, times its block's scale (summed over K after the loop)."""
    BLOCK_N: tl.constexpr = cols.shape[0]
    WORDS: tl.constexpr = BLOCK_K // 8
    kw = k0 // 8 + tl.arange(0, WORDS)
    words = tl.load(w_ptr.to(tl.pointer_type(tl.int32)) + expert * (stride_we // 4)
                    + cols[:, None].to(tl.int64) * (stride_wn // 4) + kw[None, :],
                    mask=cols_ok[:, None] & (kw < K // 8)[None, :], other=0)
    k = 8 * kw
    if ASM:  # CUDA: a word's eight codes decoded at once by PTX, a product each
        values = _e2m1_word(words)
        products = tl.zeros((BLOCK_N, WORDS), dtype=tl.float32)
        for i in tl.static_range(8):
            a = tl.load(a_row + k + i, mask=a_ok & (k < K), other=0.0).to(tl.float32)
            products += values[i] * a[None, :]
    else:  # the interpreter: the same products with a word's codes along a third axis (fewer Python-level ops)
        i = tl.arange(0, 8)
        values = _e2m1((words[:, :, None] >> (4 * i)[None, None, :]) & 0xF)
        a = tl.load(a_row + k[:, None] + i[None, :], mask=a_ok & (k < K)[:, None], other=0.0).to(tl.float32)
        products = tl.sum(values * a[None, :, :], 2)
    scale = _mx4_scales(s_ptr, expert, k0, K, cols, cols_ok, stride_se, stride_sg, BLOCK_K // 32)
    return acc + tl.reshape(tl.reshape(products, (BLOCK_N, BLOCK_K // 32, 4)) * scale[:, :, None],
                            (BLOCK_N, WORDS))


@triton.jit
def _mx4_scaled(acc, a, w_ptr, s_ptr, expert, k0, K, cols, cols_ok, stride_we, stride_wn, stride_se, stride_sg,
                HALF_K: tl.constexpr):
    """acc += A [BLOCK_M, 2 HALF_K] . W^T through Triton's scaled dot (the compiler's own e2m1
    upcast into the MMA's operand layout)."""
    kb = k0 // 2 + tl.arange(0, HALF_K)
    col = cols[:, None].to(tl.int64)
    packed = tl.load(w_ptr + expert * stride_we + col * stride_wn + kb[None, :],
                     mask=cols_ok[:, None] & (kb < K // 2)[None, :], other=0)
    g = k0 // 32 + tl.arange(0, HALF_K // 16)
    s = tl.load(s_ptr + expert * stride_se + col * stride_sg + g[None, :],
                mask=cols_ok[:, None] & (g < K // 32)[None, :], other=127)
    return tl.dot_scaled(a, None, "bf16", tl.trans(packed), s, "e2m1", acc, fast_math=True)


@triton.jit
def mx4_dequant_kernel(w_ptr, s_ptr, out_ptr, N, K, stride_we, stride_wn, stride_se, stride_sg, stride_oe,
                       stride_on, BLOCK_N: tl.constexpr, HALF_K: tl.constexpr):
    """out[e, n, k] (the activation dtype) = MXFP4 W[e, n, k], for a [BLOCK_N, 2 HALF_K] tile."""
    expert = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(2) * 2 * HALF_K
    even, odd = _mx4_tiles(w_ptr, s_ptr, expert, k0, K, cols, cols < N, stride_we, stride_wn, stride_se, stride_sg,
                           HALF_K, out_ptr.dtype.element_ty)
    k = k0 + tl.arange(0, 2 * HALF_K)
    tl.store(out_ptr + expert * stride_oe + cols[:, None].to(tl.int64) * stride_on + k[None, :],
             tl.reshape(tl.join(even, odd), (BLOCK_N, 2 * HALF_K)), mask=(cols < N)[:, None] & (k < K)[None, :])


@triton.jit
def moe_gemm_kernel(a_ptr, w_ptr, s_ptr, z_ptr, c_ptr, topk_w_ptr, sorted_rows_ptr, block_expert_ptr, num_padded_ptr,
                    bias_ptr, N, K, num_rows, stride_am, stride_we, stride_wn, stride_se, stride_sg, stride_cm,
                    stride_be, alpha, limit,
                    TOP_K: tl.constexpr, GATED: tl.constexpr, WEIGHTED: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, W4: tl.constexpr,
                    GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr, MX4: tl.constexpr,
                    MX4_DOT: tl.constexpr = False, ASM: tl.constexpr = False):
    """C[row, n] = A[row // TOP_K] . W[expert, n] for the rows of one expert's tile; GATED: W
    holds gate rows [0, N) then up rows [N, 2N) and C = silu(gate) * up; WEIGHTED: C *= w[row].
    W4: W is INT4 (see _weight_tile; s_ptr, z_ptr and their strides are its scales and zeros); MX4:
    MXFP4 (s_ptr and its strides: the block scales).
    HAS_BIAS: bias[expert, n] (gated: gate's at n, up's at N + n) added before the activation
    or the weighting. SWIGLU: gpt-oss's (min(gate, limit) sigmoid(alpha min(gate, limit)))
    (clamp(up, -limit, limit) + 1) in place of silu(gate) * up."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M < tl.load(num_padded_ptr):
        expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
        rows = tl.load(sorted_rows_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        valid = rows < num_rows  # padding of the expert's run
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        offs_k = tl.arange(0, BLOCK_K // 2 if MX4 else BLOCK_K)
        a_rows = a_ptr + (rows // TOP_K)[:, None] * stride_am
        a_ptrs = a_rows + offs_k[None, :]  # (the float and INT4 path's, a step on each time)
        dtype = a_ptr.dtype.element_ty
        if MX4 and BLOCK_M == 1:  # partial sums along K (_mx4_row_step)
            acc = tl.zeros((BLOCK_N, BLOCK_K // 8), dtype=tl.float32)
            acc_up = tl.zeros((BLOCK_N, BLOCK_K // 8), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if MX4_DOT:
                ka = k0 + tl.arange(0, BLOCK_K)
                a = tl.load(a_rows + ka[None, :], mask=valid[:, None] & (ka < K)[None, :], other=0.0)
                acc = _mx4_scaled(acc, a, w_ptr, s_ptr, expert, k0, K, offs_n, n_mask, stride_we, stride_wn, stride_se,
                                  stride_sg, BLOCK_K // 2)
                if GATED:
                    acc_up = _mx4_scaled(acc_up, a, w_ptr, s_ptr, expert, k0, K, offs_n + N, n_mask, stride_we,
                                         stride_wn, stride_se, stride_sg, BLOCK_K // 2)
            elif MX4 and BLOCK_M == 1:
                a_row = a_ptr + (rows // TOP_K) * stride_am
                acc = _mx4_row_step(acc, a_row, valid, w_ptr, s_ptr, expert, k0, K, offs_n, n_mask, stride_we,
                                    stride_wn, stride_se, stride_sg, BLOCK_K, ASM)
                if GATED:
                    acc_up = _mx4_row_step(acc_up, a_row, valid, w_ptr, s_ptr, expert, k0, K, offs_n + N, n_mask,
                                           stride_we, stride_wn, stride_se, stride_sg, BLOCK_K, ASM)
            elif MX4:  # the even and the odd inputs of the step: a dot each
                k = k0 + 2 * offs_k
                a_mask = valid[:, None] & (k < K)[None, :]
                a_even = tl.load(a_rows + k[None, :], mask=a_mask, other=0.0)
                a_odd = tl.load(a_rows + (k + 1)[None, :], mask=a_mask, other=0.0)
                acc = _mx4_step(acc, a_even, a_odd, w_ptr, s_ptr, expert, k0, K, offs_n, n_mask, stride_we, stride_wn,
                                stride_se, stride_sg, BLOCK_K // 2, dtype, PRECISION)
                if GATED:
                    acc_up = _mx4_step(acc_up, a_even, a_odd, w_ptr, s_ptr, expert, k0, K, offs_n + N, n_mask,
                                       stride_we, stride_wn, stride_se, stride_sg, BLOCK_K // 2, dtype, PRECISION)
            else:
                k = k0 + offs_k
                k_mask = k < K
                a = tl.load(a_ptrs, mask=valid[:, None] & k_mask[None, :], other=0.0)
                w = _weight_tile(w_ptr, s_ptr, z_ptr, expert, k0, k, k_mask, offs_n, n_mask, stride_we, stride_wn,
                                 stride_se, stride_sg, dtype, W4, GROUP)
                acc = tl.dot(a, w, acc, input_precision=PRECISION)
                if GATED:
                    w_up = _weight_tile(w_ptr, s_ptr, z_ptr, expert, k0, k, k_mask, offs_n + N, n_mask, stride_we,
                                        stride_wn, stride_se, stride_sg, dtype, W4, GROUP)
                    acc_up = tl.dot(a, w_up, acc_up, input_precision=PRECISION)
                a_ptrs += BLOCK_K
        if MX4 and BLOCK_M == 1:
            acc = tl.sum(acc, 1)[None, :]
            acc_up = tl.sum(acc_up, 1)[None, :]
        dtype = c_ptr.dtype.element_ty
        if HAS_BIAS:
            bias = bias_ptr + expert * stride_be + offs_n
            acc += tl.load(bias, mask=n_mask, other=0.0).to(tl.float32)[None, :]
            if GATED:
                acc_up += tl.load(bias + N, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        if GATED:
            gate = acc.to(dtype).to(tl.float32)
            if SWIGLU:
                gate = tl.minimum(gate, limit)
                up = tl.minimum(tl.maximum(acc_up.to(dtype).to(tl.float32), -limit), limit)
                glu = (gate / (1.0 + tl.exp(-gate * alpha))).to(dtype).to(tl.float32)
                acc = glu * (up + 1.0)
            else:
                silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
                acc = silu * acc_up.to(dtype).to(tl.float32)
        if WEIGHTED:
            acc = acc.to(dtype).to(tl.float32) * tl.load(topk_w_ptr + rows, mask=valid, other=0.0)[:, None]
        tl.store(c_ptr + rows[:, None] * stride_cm + offs_n[None, :], acc.to(dtype),
                 mask=valid[:, None] & n_mask[None, :])


@triton.jit
def route_kernel(logits_ptr, weights_ptr, ids_ptr, counts_ptr, slot_ptr, E, stride_l, num_tokens, scale,
                 TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, RENORM: tl.constexpr,
                 TOPK_SOFTMAX: tl.constexpr, TOKENS: tl.constexpr):
    """TOKENS tokens a program (one when compiled), each: float32 softmax of its router logits,
    the top k (best first), renormalised when RENORM, times `scale`; each chosen expert's counter
    + 1 unless the token is CUDA-graph padding. TOPK_SOFTMAX (gpt-oss): the top k of the logits,
    then the softmax over those k."""
    t = tl.program_id(0).to(tl.int64) * TOKENS + tl.arange(0, TOKENS)[:, None]
    tm = t < num_tokens
    offs = tl.arange(0, E_PAD)[None, :]
    x = tl.load(logits_ptr + t * stride_l + offs, mask=tm & (offs < E), other=float("-inf")).to(tl.float32)
    if TOPK_SOFTMAX:  # pick on the logits (-inf: no expert); the padding is below any of them
        p = tl.where(offs < E, x, float("-inf"))
        taken = float("-inf")
    else:
        p = tl.exp(x - tl.max(x, 1)[:, None])
        p = p / tl.sum(p, 1)[:, None]
        p = tl.where(offs < E, p, -1.0)
        taken = -1.0
    real = (tl.load(slot_ptr + t, mask=tm, other=-1) >= 0).to(tl.int64)
    slots = tl.arange(0, K_PAD)[None, :]
    weights = tl.zeros((TOKENS, K_PAD), dtype=tl.float32)
    ids = tl.zeros((TOKENS, K_PAD), dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(p, 1)[:, None]
        idx = tl.min(tl.where(p == best, offs, E_PAD), 1)[:, None]  # ties: the lower expert
        weights = tl.where(slots == j, best, weights)
        ids = tl.where(slots == j, idx, ids)
        p = tl.where(offs == idx, taken, p)
    # the counters at once, relaxed: an ordered atomic a pick cost ~0.7 us each (top 8: 6.8 us a token)
    picked = tm & (slots < TOP_K)
    tl.atomic_add(counts_ptr + ids, tl.zeros((TOKENS, K_PAD), dtype=tl.int64) + real, mask=picked, sem="relaxed")
    if TOPK_SOFTMAX:  # the best first: weights[0] is their max
        e = tl.where(slots < TOP_K,
                     tl.exp(weights - tl.max(tl.where(slots < TOP_K, weights, float("-inf")), 1)[:, None]), 0.0)
        weights = e / tl.sum(e, 1)[:, None]
    elif RENORM:
        weights = weights / tl.sum(weights, 1)[:, None]
    tl.store(weights_ptr + t * TOP_K + slots, weights * scale, mask=picked)
    tl.store(ids_ptr + t * TOP_K + slots, ids, mask=picked)


def fused_route(router_logits: torch.Tensor, top_k: int, renormalize: bool, counts: torch.Tensor,
                slot_mapping: torch.Tensor, warps: int = 1, topk_softmax: bool = False,
                scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """As layers.moe.route (ids int32), the weights times `scale` (DeepSeek's routed scaling),
    counting into `counts` the real tokens (slot >= 0). One warp a token: its reductions stay in
    the warp (faster than 4 warps in benchmarks/moe_kernel_bench.py)."""
    tokens, experts = router_logits.shape
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int32, device=router_logits.device)
    per = rows_per_program(tokens)
    route_kernel[(triton.cdiv(tokens, per),)](router_logits, weights, ids, counts, slot_mapping, experts,
                                              router_logits.stride(0), tokens, scale, TOP_K=top_k, K_PAD=_pow2(top_k),
                                              E_PAD=_pow2(experts), RENORM=renormalize, TOPK_SOFTMAX=topk_softmax,
                                              TOKENS=per, num_warps=warps)
    return weights, ids


@triton.jit
def align_kernel(ids_ptr, rows_ptr, block_expert_ptr, num_padded_ptr, cursor_ptr, n, E,
                 BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr, TILE_CHUNK: tl.constexpr):
    """One program: the rows (token * k + slot) grouped by expert into `rows_ptr`, each expert's
    run padded to BLOCK_M with the out-of-range row n; the rows in use and the expert of each of
    their tiles (places and tiles past them are left as they are: nothing reads them)."""
    offs_e = tl.arange(0, E_PAD)
    counts = tl.zeros((E_PAD,), dtype=tl.int32)
    for start in range(0, n, CHUNK):  # rows per expert (id -1 and past-the-end rows: bin E, E_PAD > E)
        o = start + tl.arange(0, CHUNK)
        e = tl.load(ids_ptr + o, mask=o < n, other=-1).to(tl.int32)
        counts += tl.histogram(tl.where(e < 0, E, e), E_PAD)
    counts = tl.where(offs_e < E, counts, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    total = tl.sum(padded, 0)
    tl.store(cursor_ptr + offs_e, ends - padded)  # each expert's next free place
    tl.store(num_padded_ptr, total)
    for start in range(0, total, CHUNK):  # the places in use start as padding (the GEMMs read no further)
        o = start + tl.arange(0, CHUNK)
        tl.store(rows_ptr + o, n, mask=o < total)
    for start in range(0, total // BLOCK_M, TILE_CHUNK):  # a tile's expert: how many experts end before it
        tile = start + tl.arange(0, TILE_CHUNK)
        before = (ends[None, :] <= (tile * BLOCK_M)[:, None]) & (offs_e < E)[None, :]
        expert = tl.minimum(tl.sum(before.to(tl.int32), 1), E - 1)
        tl.store(block_expert_ptr + tile, expert, mask=tile < total // BLOCK_M)
    tl.debug_barrier()  # the padding and the cursors are visible to every thread before the rows land
    for start in range(0, n, CHUNK):
        o = start + tl.arange(0, CHUNK)
        e = tl.load(ids_ptr + o, mask=o < n, other=-1).to(tl.int32)
        routed = (o < n) & (e >= 0)
        place = tl.atomic_add(cursor_ptr + tl.where(routed, e, 0), 1, mask=routed)
        tl.store(rows_ptr + place, o, mask=routed)


def align_by_expert(ids: torch.Tensor, num_experts: int, block_m: int):
    """(rows [P] int32, expert of each BLOCK_M tile [P / block_m] int32, rows in use U [1] int32):
    the flat (token * k + slot) rows grouped by expert (in no set order within an expert: each
    row's result is its own), each group padded to a multiple of block_m with the row number
    ``ids.numel()`` (out of range: not loaded, not stored); rows of expert -1 are left out.
    Only the first U places and U / block_m tiles are written. P is the worst case, fixed by
    the shape: nothing is read back to the host."""
    n = ids.numel()
    size = -(-(n + num_experts * (block_m - 1)) // block_m) * block_m
    dev = ids.device
    rows = torch.empty(size, dtype=torch.int32, device=dev)
    block_expert = torch.empty(size // block_m, dtype=torch.int32, device=dev)
    num_padded = torch.empty(1, dtype=torch.int32, device=dev)
    e_pad = _pow2(num_experts + 1)
    cursor = torch.empty(e_pad, dtype=torch.int32, device=dev)
    align_kernel[(1,)](ids, rows, block_expert, num_padded, cursor, n, num_experts, BLOCK_M=block_m,
                       E_PAD=e_pad, CHUNK=256, TILE_CHUNK=max(1, 4096 // e_pad), num_warps=8 if n > 4096 else 4)
    return rows, block_expert, num_padded


def _pow2(n: int) -> int:
    return 1 << (max(n, 1) - 1).bit_length()


class Tiles(NamedTuple):
    """A grouped GEMM's launch: rows, outputs and inputs per tile, warps, pipeline stages."""

    block_m: int
    block_n: int
    block_k: int
    warps: int
    stages: int = 3


def _tiles(rows: int, num_experts: int, k_dim: int) -> Tiles:
    """Tiles by the rows each expert gets (block_m: the same for both GEMMs of a layer) and the
    GEMM's input width. Decode reads weights for a row or two a tile: narrow tiles, many
    programs, every SM streaming weights; long inputs take 256-wide K steps, with deeper
    pipelines from 4096 (benchmarks/moe_kernel_bench.py picks them). Prefill multiplies
    (taller tiles)."""
    per_expert = rows / num_experts
    if per_expert <= 16:
        if k_dim >= 2048:
            return Tiles(16, 32, 256, 4, 5 if k_dim >= 4096 else 3)
        return Tiles(16, 64, 128, 4)
    if per_expert <= 64:
        return Tiles(32, 64, 64, 4)
    if per_expert <= 256:
        return Tiles(64, 64, 64, 4)
    return Tiles(128, 64, 64, 8)


def _weights(w, block_k: int) -> tuple[tuple, dict, int]:
    """A stacked expert family's kernel arguments: (tensors and strides, constexprs, BLOCK_K)."""
    if isinstance(w, Int4Experts):
        q, s, z = w.qweight, w.scales, w.zeros
        assert s.stride() == z.stride()
        return ((q, s, z, q.stride(0), q.stride(1), s.stride(0), s.stride(1)),
                dict(W4=True, GROUP=w.group, MX4=False), min(block_k, w.group & -w.group))  # (a power of two: divides it)
    if isinstance(w, Mxfp4Experts):
        b, s = w.blocks, w.scales
        return (b, s, s, b.stride(0), b.stride(1), s.stride(0), s.stride(1)), dict(W4=False, GROUP=1, MX4=True), \
            block_k
    return (w, w, w, w.stride(0), w.stride(1), 0, 0), dict(W4=False, GROUP=1, MX4=False), block_k


def grouped_gemm(a: torch.Tensor, w, out: torch.Tensor, weights: torch.Tensor, aligned: tuple, top_k: int,
                 gated: bool, tiles: Tiles, bias: torch.Tensor | None = None, act=None) -> None:
    """One launch over all experts (moe_gemm_kernel) for the rows of `aligned` (align_by_expert's,
    made with tiles.block_m); out has a row per (token, slot). Gated: a [T, H] is read at row //
    top_k, W holds gate then up rows, out = SiLU(gate) * up (`act`: a ClampedSwiGLU instead).
    Not gated: a has out's rows and out is scaled by the row's routing weight. `bias` [E, N]:
    added to each expert's outputs first."""
    rows, block_expert, num_padded = aligned
    n_out = out.shape[1]
    w_args, w_const, block_k = _weights(w, tiles.block_k)
    if tiles.block_m < 16 and not w_const["MX4"]:
        raise ValueError(f"tiles of {tiles.block_m} rows multiply MXFP4 experts only (tensor-core tiles: 16 rows "
                         "or more)")
    moe_gemm_kernel[(block_expert.shape[0], triton.cdiv(n_out, tiles.block_n))](
        a, *w_args[:3], out, weights, rows, block_expert, num_padded, a if bias is None else bias, n_out, a.shape[1],
        out.shape[0], a.stride(0), *w_args[3:], out.stride(0), 0 if bias is None else bias.stride(0),
        1.0 if act is None else act.alpha, 1.0 if act is None else act.limit, HAS_BIAS=bias is not None,
        SWIGLU=act is not None, TOP_K=top_k if gated else 1, GATED=gated, WEIGHTED=not gated,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=block_k,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32", num_warps=tiles.warps,
        num_stages=tiles.stages if a.is_cuda else 1,
        MX4_DOT=w_const["MX4"] and _scaled_dot(a) and tiles.block_m >= 16,
        ASM=a.is_cuda, **w_const)


def dequantize_experts(w: Mxfp4Experts, dtype: torch.dtype) -> torch.Tensor:
    """MXFP4 experts as a stacked [E, N, K] weight in `dtype` (one launch; exact, as
    quant.mxfp4.dequantize_mxfp4)."""
    num_experts, n, k = w.shape
    out = torch.empty(num_experts, n, k, dtype=dtype, device=w.blocks.device)
    b, s = w.blocks, w.scales
    block_n, half_k = 64, 128
    mx4_dequant_kernel[(num_experts, triton.cdiv(n, block_n), triton.cdiv(k, 2 * half_k))](
        b, s, out, n, k, b.stride(0), b.stride(1), s.stride(0), s.stride(1), out.stride(0), out.stride(1),
        BLOCK_N=block_n, HALF_K=half_k, num_warps=4)
    return out


# The tiles of MXFP4 experts decoded in the GEMMs at most one row an expert on average (decode's
# few tokens): one row a tile (a weight tile is read again for each of an expert's rows), multiplied
# without tensor cores (_mx4_row_step, codes decoded by PTX on CUDA); the fastest of
# moe_kernel_bench.py's sweep on gpt-oss-20b (docs/performance.md). None: _tiles'.
MX4_TILES: tuple[Tiles, Tiles] | None = (Tiles(1, 16, 256, 2), Tiles(1, 16, 256, 2))

# Tensor-core tiles' MXFP4 product on CUDA in bf16 through Triton's scaled dot (_mx4_scaled), else
# the kernel's own decode and two dots (_mx4_step, the interpreter's); measured faster from 16 tokens
# on gpt-oss-20b (moe_kernel_bench.py; docs/performance.md).
MX4_DOT = True

# The tensor-core tiles of MXFP4 experts under the scaled dot, by the rows each expert gets on
# average (one block_m for both GEMMs of a layer): ((most rows, tiles), ...), the first that holds
# wins, the last for more; the fastest of moe_kernel_bench.py --tall-sweep-tokens on gpt-oss-20b.
MX4_DOT_TILES = ((16, Tiles(16, 64, 128, 4)), (32, Tiles(32, 64, 128, 4)), (64, Tiles(64, 64, 128, 4)),
                 (None, Tiles(128, 64, 128, 4)))

# Without the scaled dot, MXFP4 experts routed more rows than this on average are decoded whole
# (dequantize_experts) for the call and multiplied by the float grouped GEMM: the kernel's own
# decode is paid again for every tile of rows, and it costs less than the decode-whole's write and
# read only at decode's few rows. With it, the experts stay in the GEMMs at every row count
# (benchmarks/moe_kernel_bench.py, gpt-oss-20b; docs/performance.md).
MX4_IN_KERNEL_ROWS = 16


def _scaled_dot(a: torch.Tensor) -> bool:
    """Whether MXFP4 tensor-core tiles multiplying `a` take Triton's scaled dot (MX4_DOT)."""
    return MX4_DOT and a.is_cuda and a.dtype == torch.bfloat16


def _mx4_dot_tiles(per_expert: float) -> Tiles:
    return next(tiles for most, tiles in MX4_DOT_TILES if most is None or per_expert <= most)


def fused_experts(x: torch.Tensor, w13, w2, weights: torch.Tensor, ids: torch.Tensor,
                  all_routed: bool = False, summed: bool = True, b13: torch.Tensor | None = None,
                  b2: torch.Tensor | None = None, act=None) -> torch.Tensor:
    """As layers.moe.torch_experts: x [T, H], w13 [E, 2I, H], w2 [E, H, I] (float tensors, or
    Int4Experts or Mxfp4Experts of those shapes), weights/ids [T, k]. `all_routed`: no id is -1, so every
    output row is written (no zero fill needed). Not `summed`: [T, k, H], each row one expert's
    weighted output, for a consumer that sums them (the next fused RMSNorm: one launch less a
    layer, a 4.9 us torch reduction at batch 1 on qwen3-30b-a3b). b13, b2, `act`: as
    layers.moe.torch_experts."""
    tokens, k = ids.shape
    num_experts, two_i, hidden = w13.shape
    n = tokens * k
    tiles1, tiles2 = _tiles(n, num_experts, hidden), _tiles(n, num_experts, two_i // 2)
    packed = isinstance(w13, Mxfp4Experts)
    dot = packed and _scaled_dot(x)
    mx4 = packed and (dot or n <= MX4_IN_KERNEL_ROWS * num_experts)  # decoded in the GEMMs
    if mx4 and MX4_TILES is not None and n <= num_experts:  # at most a row an expert on average
        tiles1, tiles2 = MX4_TILES
    elif dot:
        tiles1 = tiles2 = _mx4_dot_tiles(n / num_experts)
    aligned = align_by_expert(ids, num_experts, tiles1.block_m)
    inter = torch.empty(n, two_i // 2, dtype=x.dtype, device=x.device)
    grouped_gemm(x.contiguous(), _as_float(w13, x.dtype, mx4), inter, weights, aligned, k, True, tiles1, b13, act)
    out = (torch.empty if all_routed else torch.zeros)(n, hidden, dtype=x.dtype, device=x.device)  # -1 rows: 0
    grouped_gemm(inter, _as_float(w2, x.dtype, mx4), out, weights.contiguous(), aligned, k, False, tiles2, b2)
    out = out.view(tokens, k, hidden)
    return out.sum(1) if summed else out


def _as_float(w, dtype: torch.dtype, in_kernel: bool):
    """MXFP4 experts decoded whole for this call unless `in_kernel`; any other weight as it is."""
    return dequantize_experts(w, dtype) if isinstance(w, Mxfp4Experts) and not in_kernel else w
