"""Triton kernels for paged attention: RoPE + KV-cache write, paged prefill over a cached
prefix, split-KV decode, and the reduction of split partials.

Grouped-query attention is packed: one program owns one KV head and a tile of
BLOCK_Q query tokens x G_PAD query heads (the G query heads sharing that KV head,
padded to a power of two), so each K/V tile is loaded once for the whole group::

    rows of the q tile:  (t0,h0) (t0,h1) .. (t0,h{G_PAD-1}) (t1,h0) ..
    row r -> token q_off + r // G_PAD, query head kv_head * G + r % G_PAD (valid if < G)

A key at position j is visible to a query at position p iff j <= p, and with a sliding
window W also p - W < j (transformers' sliding_window_overlay); a query's position is
``seq_len - q_len + token``. Key tiles wholly before a tile's first window are never read
(nor their block-table entries: the KV manager frees those blocks). Softmax is online (running max m, sum l).
Rows with nothing to attend to (padding, empty splits) produce zeros, never NaN. A decode's
splits are combined by ``reduce_splits_kernel``, or (FUSED_REDUCE) by the last of them to
finish, counted in on the device's arrival counters as the split-K GEMVs do; a split prefill
item's slices always combine that way.

The key loop runs in three parts: the tiles that cross the window's lower edge (none
without a window) masked, then whole BLOCK_N tiles of keys that every row of the tile sees
(all of a cached prefix and the keys before the tile's first query token) without masks,
then the few tiles that cross the diagonal (or a decode split's ragged end) masked.
"""

from __future__ import annotations

from expresslane.quant.kernels import _quantize_e4m3
from expresslane.triton_setup import tl, triton


@triton.jit
def _rotate_half(x1, x2, cos, sin):
    """NeoX-layout RoPE of the two halves, in float32, rounded back to the input dtype."""
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    return (x1f * cos - x2f * sin).to(x1.dtype), (x2f * cos + x1f * sin).to(x1.dtype)


@triton.jit
def _rope_rows(pos_ptr, cos_sin_ptr, stride_cs, num_tokens, TOKENS: tl.constexpr, HALF: tl.constexpr,
               HALF_PAD: tl.constexpr):
    """A program's TOKENS tokens [TOKENS, 1, 1], their mask, the rotary dims [1, 1, HALF_PAD] and
    their mask, and each token's cos and sin halves (the table's row pos_ptr[t])."""
    t = tl.program_id(0).to(tl.int64) * TOKENS + tl.arange(0, TOKENS)[:, None, None]
    tm = t < num_tokens
    pos = tl.load(pos_ptr + t, mask=tm, other=0)
    d = tl.arange(0, HALF_PAD)[None, None, :]
    dm = d < HALF
    cos = tl.load(cos_sin_ptr + pos * stride_cs + d, mask=tm & dm, other=0.0)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + d, mask=tm & dm, other=0.0)
    return t, tm, d, dm, cos, sin


@triton.jit
def _head_rms_norm(x1, x2, w_ptr, d, dm, eps, HALF: tl.constexpr, OFFSET: tl.constexpr):
    """Each head's RMSNorm (Qwen3's q_norm / k_norm) over its two halves [tokens, heads, HALF],
    rounded where layers.norm.RMSNorm rounds: the normalised value to the input dtype, then times w.
    OFFSET: Gemma 3's, x / rms(x) * (1 + w) in float32, rounded once (models/gemma.py)."""
    f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
    r = tl.math.rsqrt((tl.sum(f1 * f1, 2) + tl.sum(f2 * f2, 2)) / (2 * HALF) + eps)[:, :, None]
    w1 = tl.load(w_ptr + d, mask=dm, other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + HALF + d, mask=dm, other=0.0).to(tl.float32)
    if OFFSET:
        y1, y2 = ((f1 * r * (1.0 + w1)).to(x1.dtype), (f2 * r * (1.0 + w2)).to(x2.dtype))
    else:
        y1, y2 = ((w1 * (f1 * r).to(x1.dtype).to(tl.float32)).to(x1.dtype),
                  (w2 * (f2 * r).to(x2.dtype).to(tl.float32)).to(x2.dtype))
    return y1, y2


@triton.jit
def _cache_value(x, scale, KV_FP8: tl.constexpr):
    """What the cache stores of x: x itself, or e4m3(x / scale) in an FP8 cache."""
    if KV_FP8:
        y = _quantize_e4m3(x.to(tl.float32), scale).to(tl.float8e4nv)
    else:
        y = x
    return y


@triton.jit
def _copy_rest(src, dst, valid, scale, HALF: tl.constexpr, HEAD_DIM: tl.constexpr, REST_PAD: tl.constexpr,
               KV_FP8: tl.constexpr):
    """Dims 2*HALF..HEAD_DIM of each head row [tokens, heads, 1], which partial rotary leaves as they are."""
    e = 2 * HALF + tl.arange(0, REST_PAD)[None, None, :]
    m = valid & (e < HEAD_DIM)
    tl.store(dst + e, _cache_value(tl.load(src + e, mask=m, other=0.0), scale, KV_FP8), mask=m)


@triton.jit
def rope_store_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, slot_ptr, cos_sin_ptr, q_out_ptr, cache_ptr, qn_ptr, kn_ptr,
                      stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cs,
                      stride_c_kv, stride_c_slot, stride_c_head, k_scale, v_scale, norm_eps, num_tokens,
                      HQ: tl.constexpr, HK: tl.constexpr, HALF: tl.constexpr, HQ_PAD: tl.constexpr,
                      HK_PAD: tl.constexpr, HALF_PAD: tl.constexpr, KV_FP8: tl.constexpr, QK_NORM: tl.constexpr,
                      NORM_OFFSET: tl.constexpr, HEAD_DIM: tl.constexpr, REST_PAD: tl.constexpr,
                      TOKENS: tl.constexpr):
    """TOKENS new tokens a program (blocks [token, head, dim]): rotate their q heads into q_out
    ([T, HQ, HEAD_DIM]), rotate their k heads and write them with their v heads into each token's
    cache slot (an FP8 cache: k / k_scale and v / v_scale as e4m3). The rotation covers dims
    0..2*HALF by the cos|sin row pos_ptr[t] of the table; the rest of a head (partial rotary,
    REST_PAD > 0) is copied. QK_NORM (whole rotation only): each q and k head is RMS-normalised
    first (weights qn_ptr, kn_ptr; NORM_OFFSET: Gemma's (1 + w) form)."""
    t, tm, d, dm, cos, sin = _rope_rows(pos_ptr, cos_sin_ptr, stride_cs, num_tokens, TOKENS, HALF, HALF_PAD)
    h = tl.arange(0, HQ_PAD)[None, :, None]
    m = tm & (h < HQ) & dm
    src = q_ptr + t * stride_qt + h * stride_qh + d
    x1, x2 = tl.load(src, mask=m, other=0.0), tl.load(src + HALF, mask=m, other=0.0)
    if QK_NORM:
        x1, x2 = _head_rms_norm(x1, x2, qn_ptr, d, dm, norm_eps, HALF, NORM_OFFSET)
    r1, r2 = _rotate_half(x1, x2, cos, sin)
    dst = q_out_ptr + t * (HQ * HEAD_DIM) + h * HEAD_DIM + d
    tl.store(dst, r1, mask=m)
    tl.store(dst + HALF, r2, mask=m)
    if REST_PAD > 0:
        _copy_rest(q_ptr + t * stride_qt + h * stride_qh, q_out_ptr + t * (HQ * HEAD_DIM) + h * HEAD_DIM,
                   tm & (h < HQ), 1.0, HALF, HEAD_DIM, REST_PAD, False)
    slot = tl.load(slot_ptr + t, mask=tm, other=-1)
    hk = tl.arange(0, HK_PAD)[None, :, None]
    has_slot = (slot >= 0) & (hk < HK)  # padding tokens of a CUDA-graph batch carry slot -1
    mk = has_slot & dm
    k_src = k_ptr + t * stride_kt + hk * stride_kh + d
    k1, k2 = tl.load(k_src, mask=mk, other=0.0), tl.load(k_src + HALF, mask=mk, other=0.0)
    if QK_NORM:
        k1, k2 = _head_rms_norm(k1, k2, kn_ptr, d, dm, norm_eps, HALF, NORM_OFFSET)
    k1, k2 = _rotate_half(k1, k2, cos, sin)
    k_dst = cache_ptr + slot * stride_c_slot + hk * stride_c_head + d
    tl.store(k_dst, _cache_value(k1, k_scale, KV_FP8), mask=mk)
    tl.store(k_dst + HALF, _cache_value(k2, k_scale, KV_FP8), mask=mk)
    v_src = v_ptr + t * stride_vt + hk * stride_vh + d
    tl.store(k_dst + stride_c_kv, _cache_value(tl.load(v_src, mask=mk), v_scale, KV_FP8), mask=mk)
    tl.store(k_dst + stride_c_kv + HALF, _cache_value(tl.load(v_src + HALF, mask=mk), v_scale, KV_FP8), mask=mk)
    if REST_PAD > 0:
        head = cache_ptr + slot * stride_c_slot + hk * stride_c_head
        _copy_rest(k_ptr + t * stride_kt + hk * stride_kh, head, has_slot, k_scale, HALF, HEAD_DIM, REST_PAD, KV_FP8)
        _copy_rest(v_ptr + t * stride_vt + hk * stride_vh, head + stride_c_kv, has_slot, v_scale, HALF, HEAD_DIM,
                   REST_PAD, KV_FP8)


@triton.jit
def _load_kv(ptrs, mask, d_mask, CAUSAL: tl.constexpr, MASK_D: tl.constexpr):
    """A K or V tile: masked by key (`mask`) on a causal tile, by head dim alone when the head
    dim is padded, not at all otherwise."""
    if CAUSAL:
        x = tl.load(ptrs, mask=mask, other=0.0)
    elif MASK_D:
        x = tl.load(ptrs, mask=d_mask, other=0.0)
    else:
        x = tl.load(ptrs)
    return x


@triton.jit
def _attend_keys(acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, table_ptr, start, hi, q_pos, kv_head_off, d, d_ok,
                 qk_scale, cap_in, cap_out, stride_kb, stride_ks, k_min, window, BLOCK_N: tl.constexpr,
                 PAGE: tl.constexpr, CAUSAL: tl.constexpr, MASK_D: tl.constexpr, PRECISION: tl.constexpr,
                 SOFTCAP: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """Keys start..start+BLOCK_N into the online softmax of the tile's rows. CAUSAL=False is
    only for a tile whose keys are all < hi and visible to every row: no masks, no -inf.
    SOFTCAP: each raw score s becomes cap_out * tanh(s * cap_in), already in the exp2 domain
    (the caller passes qk_scale 1). HAS_WINDOW: keys before `k_min` (no row's window reaches
    them) are not loaded."""
    n = start + tl.arange(0, BLOCK_N)
    n_ok = n < hi
    if HAS_WINDOW:
        n_ok = n_ok & (n >= k_min)
    if CAUSAL:
        page = tl.load(table_ptr + n // PAGE, mask=n_ok, other=0)
    else:
        page = tl.load(table_ptr + n // PAGE)
    kv_off = page.to(tl.int64) * stride_kb + (n % PAGE) * stride_ks + kv_head_off
    k = _load_kv(k_cache_ptr + kv_off[None, :] + d[:, None], n_ok[None, :] & d_ok[:, None], d_ok[:, None], CAUSAL,
                 MASK_D).to(q.dtype)  # (a no-op unless the cache is FP8)
    s = tl.dot(q, k, input_precision=PRECISION)
    if SOFTCAP:  # tanh(x) = 1 - 2 / (e^2x + 1): exact at both ends (e^2x = inf or 0)
        s = (1.0 - 2.0 / (tl.math.exp2(s * (cap_in * 2.8853900817779268)) + 1.0)) * cap_out
    if CAUSAL:
        seen = n_ok[None, :] & (n[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            seen = seen & (n[None, :] > q_pos[:, None] - window)
        s = tl.where(seen, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that sees no key yet
        p = tl.math.exp2(s - m_safe[:, None])
    else:  # every key visible: the scale rides in one multiply-add per score (qk_scale > 0)
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        m_safe = m_new
        p = tl.math.exp2(s * qk_scale - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = _load_kv(v_cache_ptr + kv_off[:, None] + d[None, :], n_ok[:, None] & d_ok[None, :], d_ok[None, :], CAUSAL,
                 MASK_D).to(q.dtype)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def paged_attention_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_acc_ptr, part_ml_ptr, count_ptr,
        block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, work_ptr, sinks_ptr,
        scale, num_splits, k_scale, v_scale, softcap, window,
        stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_ot, stride_oh, stride_bt,
        stride_pa_s, stride_pa_p, stride_pa_t, stride_pa_h, stride_ml_s, stride_ml_p, stride_ml_t, stride_ml_h,
        G: tl.constexpr, G_PAD: tl.constexpr, HK: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
        HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, PAGE: tl.constexpr, DECODE: tl.constexpr,
        MASK_ALL: tl.constexpr, FUSED_REDUCE: tl.constexpr, PRECISION: tl.constexpr, SOFTCAP: tl.constexpr,
        HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr):
    """Prefill (DECODE=False): one program per (work item, KV head), the HK KV heads of an item
    adjacent (program w * HK + kv_head), so the work list's order is the launch order. An item
    (work_ptr row: seq, q_off, split, splits, slot) is a tile of a seq's query tokens and, when
    `splits` > 1, one of that many slices of its keys: partials go to partial slot `slot +
    split` and the last slice to finish combines them (a short chunk after a long context
    reads its keys over many programs, as a decode does). Decode (DECODE=True): program 0-axis
    = seq, 1-axis = KV head, 2-axis = split of its keys; with more than one split, partials go
    to part_acc/part_ml (slot: the seq), combined by the last split (FUSED_REDUCE) or by
    reduce_splits_kernel; one split writes its output itself. A work row whose seq is -1 is
    padding: its programs return at once. HAS_WINDOW: each query sees its last `window` keys;
    the keys split start at the tile's first window. HAS_SINKS: each query head's learned logit
    (sinks_ptr, gpt-oss) joins the softmax's denominator as a key with a zero value; split 0
    starts its running max and sum from it, so the splits' combination counts it once.
    Partial addresses: slot * stride_s + split * stride_p + token in the tile * stride_t +
    head * stride_h (+ the head dim for part_acc, + 0 / 1 for m / l in part_ml)."""
    if DECODE:
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        q_off = 0
        splits = num_splits
        slot = seq
    else:
        w = tl.program_id(0) // HK
        kv_head = tl.program_id(0) % HK
        seq = tl.load(work_ptr + 5 * w)
        if seq < 0:  # a padding item of a captured launch (its grid fits any step of its bucket)
            return
        q_off = tl.load(work_ptr + 5 * w + 1)
        split = tl.load(work_ptr + 5 * w + 2)
        splits = tl.load(work_ptr + 5 * w + 3)
        slot = tl.load(work_ptr + 5 * w + 4)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    ctx = tl.load(seq_lens_ptr + seq)

    rows = tl.arange(0, BLOCK_Q * G_PAD)
    tok = q_off + rows // G_PAD
    head = kv_head * G + rows % G_PAD
    row_ok = (tok < q_len) & (rows % G_PAD < G)
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if k_cache_ptr.dtype.element_ty == tl.float8e4nv and q.dtype == tl.bfloat16:
        # 16-bit dots over an FP8 cache in float16: e4m3 -> f16 is one cvt per two values, while
        # e4m3 -> bf16 goes through f16 -> bf16, a quarter-rate conversion that bounded the
        # decode kernel. bf16 q converts exactly (within +-65504; p in [0, 1] gains precision).
        q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
    q_first = ctx - q_len + q_off  # position of the tile's first query token
    q_pos = q_first + rows // G_PAD

    # keys this tile can see at all; a split takes a BLOCK_N-aligned slice of them (one split: all)
    kv_end = tl.minimum(ctx, q_first + BLOCK_Q)
    if HAS_WINDOW:
        k_min = tl.maximum(q_first - window + 1, 0)  # the first row's window: no row sees a key before it
    else:
        k_min = 0
    k_start = k_min // BLOCK_N * BLOCK_N
    per_split = tl.cdiv(tl.cdiv(kv_end - k_start, splits), BLOCK_N) * BLOCK_N
    lo = k_start + split * per_split
    hi = tl.minimum(lo + per_split, kv_end)
    # keys lo..mid are visible to every row (<= q_first) and fill whole tiles: no masks there;
    # only the tiles from mid on (the diagonal, a split's ragged end) are masked. MASK_ALL masks
    # every tile (one loop: less code, for tile shapes where that measures faster)
    if MASK_ALL:
        mid = lo
    else:
        mid = lo + tl.maximum(tl.minimum(hi, q_first + 1) - lo, 0) // BLOCK_N * BLOCK_N
    if HAS_WINDOW:  # tiles before `full` cross some row's window edge (the last valid row's is kv_end - window)
        full = tl.minimum(lo + tl.cdiv(tl.maximum(kv_end - window - lo, 0), BLOCK_N) * BLOCK_N, mid)
    else:
        full = lo

    if HAS_SINKS:  # in the exp2 domain of m_i (scores times log2 e)
        sink = tl.load(sinks_ptr + head, mask=rows % G_PAD < G, other=float("-inf")).to(tl.float32)
        m_i = tl.where(split == 0, sink * 1.4426950408889634, float("-inf"))
        l_i = tl.where(m_i == float("-inf"), 0.0, 1.0)
    else:
        m_i = tl.full([BLOCK_Q * G_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_Q * G_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * G_PAD, D_PAD], tl.float32)
    qk_scale = scale * k_scale * 1.4426950408889634  # exp(x) = exp2(x * log2 e); an FP8 cache's k scale
    cap_in = scale * k_scale
    cap_out = 1.0
    if SOFTCAP:  # softcap * tanh(scaled score / softcap), times log2 e
        cap_in = cap_in / softcap
        cap_out = softcap * 1.4426950408889634
        qk_scale = 1.0
    table = block_tables_ptr + seq * stride_bt
    kv_head_off = kv_head * stride_kh
    for start in range(lo, full, BLOCK_N):
        acc, m_i, l_i = _attend_keys(acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, table, start, hi, q_pos, kv_head_off,
                                     d, d_ok, qk_scale, cap_in, cap_out, stride_kb, stride_ks, k_min, window, BLOCK_N,
                                     PAGE, True, HEAD_DIM != D_PAD, PRECISION, SOFTCAP, HAS_WINDOW)
    for start in range(full, mid, BLOCK_N):
        acc, m_i, l_i = _attend_keys(acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, table, start, hi, q_pos, kv_head_off,
                                     d, d_ok, qk_scale, cap_in, cap_out, stride_kb, stride_ks, k_min, window, BLOCK_N,
                                     PAGE, False, HEAD_DIM != D_PAD, PRECISION, SOFTCAP, HAS_WINDOW)
    for start in range(mid, hi, BLOCK_N):
        acc, m_i, l_i = _attend_keys(acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, table, start, hi, q_pos, kv_head_off,
                                     d, d_ok, qk_scale, cap_in, cap_out, stride_kb, stride_ks, k_min, window, BLOCK_N,
                                     PAGE, True, HEAD_DIM != D_PAD, PRECISION, SOFTCAP, HAS_WINDOW)

    acc = acc * v_scale
    o = out_ptr + (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    if splits > 1:
        local = rows // G_PAD
        pa = part_acc_ptr + slot * stride_pa_s + local[:, None] * stride_pa_t + head[:, None] * stride_pa_h + d[None, :]
        ml = part_ml_ptr + slot * stride_ml_s + local * stride_ml_t + head * stride_ml_h
        tl.store(pa + split * stride_pa_p, acc, mask=row_ok[:, None])
        tl.store(ml + split * stride_ml_p, m_i, mask=row_ok)
        tl.store(ml + split * stride_ml_p + 1, l_i, mask=row_ok)
        if FUSED_REDUCE or not DECODE:  # the last split of this (slot, KV head) to arrive combines them all
            tl.debug_barrier()  # every thread's partial is written before the (single-thread) atomic
            count = tl.atomic_add(count_ptr + slot * HK + kv_head, 1, sem="acq_rel", scope="gpu")
            if count == splits - 1:
                _combine_splits(pa, ml, splits, stride_pa_p, stride_ml_p, o, row_ok, d_ok, BLOCK_Q * G_PAD, D_PAD)
                tl.store(count_ptr + slot * HK + kv_head, 0)
    else:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(o, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _combine_splits(acc_ptrs, ml_ptrs, num_splits, stride_acc, stride_ml, out_ptrs, row_ok, d_ok, ROWS: tl.constexpr,
                    D_PAD: tl.constexpr):
    """The rows' output from their splits' partials (acc at acc_ptrs + split * stride_acc, m and
    l at ml_ptrs + split * stride_ml, + 1): an online softmax over the splits, read past L1
    (other programs wrote them)."""
    m = tl.full([ROWS], float("-inf"), tl.float32)
    l = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, D_PAD], tl.float32)
    for s in range(num_splits):
        m_s = tl.load(ml_ptrs + s * stride_ml, mask=row_ok, other=float("-inf"), cache_modifier=".cg")
        l_s = tl.load(ml_ptrs + s * stride_ml + 1, mask=row_ok, other=0.0, cache_modifier=".cg")
        a_s = tl.load(acc_ptrs + s * stride_acc, mask=row_ok[:, None], other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m, m_s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key in any split so far
        alpha, beta = tl.math.exp2(m - m_safe), tl.math.exp2(m_s - m_safe)
        acc = acc * alpha[:, None] + a_s * beta[:, None]
        l = l * alpha + l_s * beta
        m = m_new
    out = acc / tl.where(l == 0.0, 1.0, l)[:, None]
    tl.store(out_ptrs, out.to(out_ptrs.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def reduce_splits_kernel(part_acc_ptr, part_ml_ptr, out_ptr, num_splits, stride_pa_s, stride_pa_h, stride_pml_s,
                         stride_ot, stride_oh, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                         MAX_SPLITS: tl.constexpr):
    """out[seq, head] = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s (M = max_s m_s)."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, MAX_SPLITS)
    s_ok = s < num_splits
    ml = part_ml_ptr + seq * stride_pml_s + head * (2 * num_splits) + 2 * s
    m = tl.load(ml, mask=s_ok, other=float("-inf"))
    l = tl.load(ml + 1, mask=s_ok, other=0.0)
    m_max = tl.max(m, 0)
    w = tl.where(m == float("-inf"), 0.0, tl.math.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max)))
    d = tl.arange(0, D_PAD)
    acc = tl.load(part_acc_ptr + seq * stride_pa_s + head * stride_pa_h + s[:, None] * D_PAD + d[None, :],
                  mask=s_ok[:, None], other=0.0)
    num = tl.sum(acc * w[:, None], 0)
    den = tl.sum(l * w, 0)
    out = num / tl.where(den == 0.0, 1.0, den)
    tl.store(out_ptr + seq * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


@triton.jit
def merge_lse_kernel(a_ptr, b_ptr, lse_a_ptr, lse_b_ptr, out_ptr, n, stride_ah, stride_at, stride_bh, stride_bt,
                     stride_lah, stride_lat, stride_lbh, stride_lbt, stride_ot, stride_oh, HEAD_DIM: tl.constexpr,
                     D_PAD: tl.constexpr, BLOCK_T: tl.constexpr):
    """out[t, h] = (a[h, t] e^lse_a + b[h, t] e^lse_b) / (e^lse_a + e^lse_b): two attentions of the
    same queries over disjoint keys, each normalized over its own (every row saw a key in both)."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1)
    t_ok = t < n
    d = tl.arange(0, D_PAD)
    ok = t_ok[:, None] & (d < HEAD_DIM)[None, :]
    la = tl.load(lse_a_ptr + h * stride_lah + t * stride_lat, mask=t_ok, other=0.0)
    lb = tl.load(lse_b_ptr + h * stride_lbh + t * stride_lbt, mask=t_ok, other=0.0)
    wa = 1.0 / (1.0 + tl.math.exp2((lb - la) * 1.4426950408889634))  # e^la / (e^la + e^lb)
    a = tl.load(a_ptr + h * stride_ah + t[:, None] * stride_at + d[None, :], mask=ok, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + h * stride_bh + t[:, None] * stride_bt + d[None, :], mask=ok, other=0.0).to(tl.float32)
    o = b + (a - b) * wa[:, None]
    tl.store(out_ptr + t[:, None] * stride_ot + h * stride_oh + d[None, :], o.to(out_ptr.dtype.element_ty), mask=ok)
