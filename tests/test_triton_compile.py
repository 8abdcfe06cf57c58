"""The Triton compiler's front end (Python AST -> TTIR) on CPU, for every kernel: the
interpreter runs code that does not type-check (e.g. a variable redefined with another
shape inside an `if` runs there and fails to compile on a GPU). Each kernel compiles
with the constexprs the engine launches it with, for the shapes of real models. Runs
in a subprocess, because the test session imports the kernels in interpreter mode."""

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

# pointers by argument name; every other pointer is an activation (the case's dtype)
_POINTERS = {"pos_ptr": "*i64", "slot_ptr": "*i64", "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32",
             "query_start_loc_ptr": "*i32", "work_ptr": "*i32", "cos_sin_ptr": "*fp32", "part_acc_ptr": "*fp32",
             "part_ml_ptr": "*fp32", "part_ptr": "*fp32", "count_ptr": "*i32", "lse_a_ptr": "*fp32",
             "lse_b_ptr": "*fp32"}
_FLOATS = {"scale", "eps", "k_scale", "v_scale", "norm_eps", "softcap", "alpha", "limit"}


def _cases():
    """(kernel name, activation dtype, constexprs[, pointer types by name]) for every launch
    configuration."""
    pow2 = lambda n: 1 << (n - 1).bit_length()  # noqa: E731
    # Llama-3-8B, Qwen2.5-0.5B, MQA, a padded head dim (96 -> 128: the head-dim masks)
    for heads, kv_heads, dim in ((32, 8, 128), (14, 2, 64), (4, 1, 128), (12, 4, 96)):
        g = heads // kv_heads
        for kv_fp8 in (False, True):  # --kv-cache-dtype auto / fp8
            for qk_norm in (False, True):  # Qwen3's per-head q_norm / k_norm folded in
                yield "rope_store_kernel", "bf16", dict(
                    HQ=heads, HK=kv_heads, HALF=dim // 2, HQ_PAD=pow2(heads), HK_PAD=pow2(kv_heads),
                    HALF_PAD=pow2(dim // 2), KV_FP8=kv_fp8, QK_NORM=qk_norm, NORM_OFFSET=False, HEAD_DIM=dim,
                    REST_PAD=0, TOKENS=1), \
                    dict(cache_ptr="*fp8e4nv") if kv_fp8 else {}
            # partial rotary (Phi-4-mini: 3/4 of each head rotated, the rest copied)
            rot_half = dim * 3 // 8
            yield "rope_store_kernel", "bf16", dict(
                HQ=heads, HK=kv_heads, HALF=rot_half, HQ_PAD=pow2(heads), HK_PAD=pow2(kv_heads),
                HALF_PAD=pow2(rot_half), KV_FP8=kv_fp8, QK_NORM=False, NORM_OFFSET=False, HEAD_DIM=dim,
                REST_PAD=pow2(dim - 2 * rot_half), TOKENS=1), \
                dict(cache_ptr="*fp8e4nv") if kv_fp8 else {}
        for dtype, precision, cache in (("bf16", "tf32", {}), ("fp32", "ieee", {}),
                                        ("bf16", "tf32", dict(k_cache_ptr="*fp8e4nv", v_cache_ptr="*fp8e4nv"))):
            # decode, then every prefill tile shape the benchmark sweeps (the tables' entries among them)
            # (a sliding window and attention sinks, as gpt-oss's sliding layers, with the first of each kind)
            for decode, rows, block_n, mask_all, fused, window in (
                    (True, 16, 64, False, False, True), (True, 16, 64, False, False, False),
                    (True, 16, 64, True, False, False), (True, 16, 64, False, True, False),
                    (False, 64, 64, False, False, True), (False, 64, 64, False, False, False),
                    (False, 64, 64, True, False, False), (False, 128, 128, False, False, False),
                    (False, 256, 32, False, False, False), (False, 64, 32, False, False, False)):
                yield "paged_attention_kernel", dtype, dict(
                    G=g, G_PAD=pow2(g), HK=kv_heads, BLOCK_Q=max(1, rows // pow2(g)), BLOCK_N=block_n, HEAD_DIM=dim,
                    D_PAD=max(16, pow2(dim)), PAGE=16, DECODE=decode, MASK_ALL=mask_all, FUSED_REDUCE=fused,
                    PRECISION=precision, SOFTCAP=False, HAS_WINDOW=window, HAS_SINKS=window), cache
        yield "reduce_splits_kernel", "bf16", dict(HEAD_DIM=dim, D_PAD=max(16, pow2(dim)), MAX_SPLITS=16)
        yield "merge_lse_kernel", "bf16", dict(HEAD_DIM=dim, D_PAD=max(16, pow2(dim)), BLOCK_T=16)  # library prefill
    # Gemma 3 (gemma-3-12b: 16 heads, 8 KV heads of 256): its (1 + w) q/k norms in the RoPE kernel
    yield "rope_store_kernel", "bf16", dict(HQ=16, HK=8, HALF=128, HQ_PAD=16, HK_PAD=8, HALF_PAD=128, KV_FP8=False,
                                            QK_NORM=True, NORM_OFFSET=True, HEAD_DIM=256, REST_PAD=0, TOKENS=1)
    # fused norm and SiLU-and-mul (layers/triton_ops.py), also quantizing their output for an FP8 linear
    fp8_out = dict(q_ptr="*fp8e4nv", scale_ptr="*fp32")
    plain = dict(OFFSET=False, PRE_NORM=False, ROWS=1)
    for has_res in (True, False):
        for fp8 in (False, True):
            yield "_rmsnorm_kernel", "bf16", dict(HAS_RES=has_res, FP8_OUT=fp8, BLOCK=4096, PARTS=1, **plain), fp8_out
    yield "_rmsnorm_kernel", "bf16", dict(HAS_RES=True, FP8_OUT=False, BLOCK=2048, PARTS=8, **plain), fp8_out  # MoE
    for pre in (False, True):  # Gemma's (1 + w) norms; the post-attention norm joining the pre-MLP one's pass
        yield "_rmsnorm_kernel", "bf16", dict(HAS_RES=True, FP8_OUT=False, BLOCK=4096, PARTS=1, OFFSET=True,
                                              PRE_NORM=pre, ROWS=1), fp8_out
    for fp8, block in ((False, 1024), (True, 16384)):
        yield "_silu_mul_kernel", "bf16", dict(FP8_OUT=fp8, BLOCK=block, ROWS=1), fp8_out
    # quantized linear layers (quant/kernels.py): FP8 per-channel, INT4 by groups; every tile shape
    for bm, bn, bk in ((16, 64, 128), (64, 64, 64), (128, 128, 64)):
        tiles = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, PRECISION="tf32")
        for has_bias in (True, False):
            yield "quant_gemm_kernel", "bf16", dict(FP8=True, GROUP=1, HAS_BIAS=has_bias, **tiles), dict(
                w_ptr="*fp8e4nv", scale_ptr="*fp32", zero_ptr="*fp32")
        yield "quant_gemm_kernel", "bf16", dict(FP8=False, GROUP=128, HAS_BIAS=False, **tiles), dict(
            w_ptr="*i32", scale_ptr="*fp16", zero_ptr="*u8")
    for one_pass, block in ((True, 16384), (False, 4096)):
        yield "per_token_quant_fp8_kernel", "bf16", dict(BLOCK=block, ONE_PASS=one_pass), dict(
            q_ptr="*fp8e4nv", scale_ptr="*fp32")
    # decode GEMVs (quant/gemv.py): bf16 / fp8 (x quantized before), split or not
    fp8_ptrs = dict(w_ptr="*fp8e4nv", ws_ptr="*fp32", xs_ptr="*fp32", x_ptr="*fp8e4nv")
    for fp8, dot, ptrs in ((False, "act", {}), (True, "fp8", fp8_ptrs)):
        for split, even in ((1, True), (8, False)):
            yield "gemv_kernel", "bf16", dict(FP8=fp8, DOT=dot, HAS_BIAS=split == 1, SPLIT_K=split > 1, EVEN=even,
                                              BLOCK_M=16, BLOCK_N=64, BLOCK_K=256), ptrs
    # the fused decode layer's GEMVs (layers/fused_gemv.py): QKV and gate|up (+norm), o_proj (+residual),
    # down (+SiLU-and-mul, +residual); split or not
    for norm, silu, res in ((True, False, False), (False, False, True), (False, True, True)):
        for split, even in ((1, True), (8, False)):
            yield "fused_gemv_kernel", "bf16", dict(NORM=norm, SILU=silu, HAS_RES=res, HAS_BIAS=split == 1,
                                                    SPLIT_K=split > 1, EVEN=even, DOT="act", BLOCK_M=16,
                                                    BLOCK_N=64, BLOCK_K=128), dict(sq_ptr="*fp32")
    for split in (1, 16):
        yield "int4_gemv_kernel", "bf16", dict(GROUP=128, ROWS=8, HAS_BIAS=True, SPLIT_K=split > 1, EVEN_N=split > 1,
                                               BLOCK_N=256), dict(qw_ptr="*i32", scale_ptr="*fp16", zero_ptr="*u8")
    yield "int4_dequant_kernel", "bf16", dict(GROUP=128, BLOCK_R=16, BLOCK_N=256), dict(
        qw_ptr="*i32", scale_ptr="*fp16", zero_ptr="*u8")
    # the fused MoE grouped GEMM (layers/fused_moe.py): gate/up with SiLU-and-mul, and down; every tile shape
    moe = dict(topk_w_ptr="*fp32", sorted_rows_ptr="*i32", block_expert_ptr="*i32", num_padded_ptr="*i32")
    int4 = dict(w_ptr="*i32", s_ptr="*fp16", z_ptr="*u8")  # INT4 experts (AWQ / GPTQ checkpoints)
    for bm, bn, bk in ((16, 32, 128), (128, 64, 64)):  # decode's tile and the largest (the front end sees shapes)
        for dtype, precision in (("bf16", "tf32"), ("fp32", "ieee")):
            for top_k, gated in ((8, True), (1, False)):
                for w4, group in ((False, 1), (True, 128)):
                    yield "moe_gemm_kernel", dtype, dict(
                        TOP_K=top_k, GATED=gated, WEIGHTED=not gated, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                        PRECISION=precision, W4=w4, GROUP=group, HAS_BIAS=False, SWIGLU=False, MX4=False), {
                        **moe, **(int4 if w4 else {})}
            for top_k, gated in ((4, True), (1, False)):  # gpt-oss as shipped: MXFP4, biases, the clamped SwiGLU
                for dot in (False, True) if bm == 16 else (True,):  # the product: own decode, Triton's scaled dot
                    yield "moe_gemm_kernel", "bf16", dict(TOP_K=top_k, GATED=gated, WEIGHTED=not gated, BLOCK_M=bm,
                                                          BLOCK_N=bn, BLOCK_K=bk, PRECISION="tf32", W4=False, GROUP=1,
                                                          HAS_BIAS=True, SWIGLU=gated, MX4=True, MX4_DOT=dot), {
                        **moe, "w_ptr": "*u8", "s_ptr": "*u8", "z_ptr": "*u8"}
    for top_k, gated in ((4, True), (1, False)):  # MXFP4 in tiles of one row (no tensor cores), PTX's decode
        yield "moe_gemm_kernel", "bf16", dict(TOP_K=top_k, GATED=gated, WEIGHTED=not gated, BLOCK_M=1, BLOCK_N=32,
                                              BLOCK_K=128, PRECISION="tf32", W4=False, GROUP=1, HAS_BIAS=True,
                                              SWIGLU=gated, MX4=True, ASM=True), {
            **moe, "w_ptr": "*u8", "s_ptr": "*u8", "z_ptr": "*u8"}
    # MXFP4 experts decoded whole for a prefill's grouped GEMMs
    yield "mx4_dequant_kernel", "bf16", dict(BLOCK_N=64, HALF_K=128), dict(w_ptr="*u8", s_ptr="*u8")
    # multi-LoRA shrink and expand (layers/lora_kernels.py): bf16 and float32 activations
    lora = dict(sorted_ptr="*i32", tiles_ptr="*i32", part_ptr="*fp32")
    for dtype, precision in (("bf16", "tf32"), ("fp32", "ieee")):
        for n, split in ((16, True), (64, False), (256, True)):  # rank columns: one slice of rank 16 .. three of 64
            yield "lora_shrink_kernel", dtype, dict(BLOCK_M=16, BLOCK_N=n, BLOCK_K=64, SPLIT_K=split,
                                                    PRECISION=precision), lora
        yield "lora_expand_kernel", dtype, dict(BLOCK_M=16, BLOCK_N=64, BLOCK_R=16, PRECISION=precision), lora
    # a one-token step's GEMV with the adapter inline: split-K or not, rank 16 and 64, with a bias
    for dtype, ieee in (("bf16", False), ("fp32", True)):
        for split, rank_pad in ((True, 16), (False, 64)):
            yield "lora_gemv_kernel", dtype, dict(HAS_BIAS=not split, SPLIT_K=split, EVEN=split, IEEE=ieee, BLOCK_N=64,
                                                  BLOCK_K=128, BLOCK_R=rank_pad), lora
    # multi-head latent attention (attention/mla_kernels.py) at DeepSeek's dims: the latent norm, RoPE and cache
    # write (V2-Lite's 16 heads, V3's 128), the attention with and without key splits, the splits' combine
    mla = dict(tables_ptr="*i32", qsl_ptr="*i32", part_o_ptr="*fp32", part_lse_ptr="*fp32")
    for heads in (16, 128):
        yield "latent_rope_store_kernel", "bf16", dict(H=heads, H_PAD=heads, L=512, L_PAD=512, HALF=32, HALF_PAD=32,
                                                       TOKENS=1)
    for split in (False, True):
        yield "latent_attention_kernel", "bf16", dict(L=512, R=64, L_PAD=512, R_PAD=64, BLOCK_H=16, BLOCK_N=32,
                                                      PAGE=16, SEQS_PAD=64, SPLIT=split, PRECISION="tf32"), mla
    for splits in (16, 64):
        yield "reduce_latent_splits_kernel", "bf16", dict(L=512, L_PAD=512, SPLITS_PAD=splits, BLOCK_L=128), mla
    # the sampler's penalties (runner/penalty_kernel.py): float32 logits, per-row counts and seen flags
    yield "_penalize", "fp32", dict(BLOCK=1024), dict(counts_ptr="*i32", seen_ptr="*u8", logit_rows_ptr="*i64",
                                                     state_rows_ptr="*i64")
    # routing (Mixtral 8 x top-2 renormalised, Qwen3-MoE 128 x top-8) and the alignment of rows by expert
    for experts, k, renorm, topk_softmax in ((8, 2, True, False), (128, 8, True, False), (7, 1, False, False),
                                             (32, 4, False, True)):  # (gpt-oss: the softmax of the top k)
        pow2e, pow2k = pow2(experts), pow2(k)
        yield "route_kernel", "bf16", dict(TOP_K=k, K_PAD=pow2k, E_PAD=pow2e, RENORM=renorm,
                                           TOPK_SOFTMAX=topk_softmax, TOKENS=1), dict(
            weights_ptr="*fp32", ids_ptr="*i32", counts_ptr="*i64")
        for ids in ("*i32", "*i64"):  # routed here, or local ids after expert-parallel dispatch
            yield "align_kernel", "bf16", dict(BLOCK_M=16, E_PAD=pow2(experts + 1), CHUNK=256,
                                               TILE_CHUNK=max(1, 4096 // pow2(experts + 1))), dict(
                ids_ptr=ids, rows_ptr="*i32", block_expert_ptr="*i32", num_padded_ptr="*i32", cursor_ptr="*i32")


def _compile_all() -> None:
    import triton
    from triton._C import libtriton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.compiler import ASTSource

    import expresslane

    root = Path(expresslane.__file__).parent  # every module of the package with a kernel
    modules = [importlib.import_module(".".join(p.relative_to(root.parent).with_suffix("").parts))
               for p in sorted(root.rglob("*.py")) if "@triton.jit" in p.read_text()]
    kernels = {name: fn for module in modules for name, fn in vars(module).items()
               if isinstance(fn, triton.runtime.JITFunction)}
    target = GPUTarget("cuda", 90, 32)  # H100/H200
    backend = CUDABackend(target)
    options = backend.parse_options({})
    compiled = set()
    for name, dtype, constexprs, *pointers in _cases():
        fn = kernels[name]
        # constexprs a case leaves out take the kernel's defaults
        constexprs = {**{p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}, **constexprs}
        pointers = {**_POINTERS, **(pointers[0] if pointers else {})}
        signature = {}
        for arg in fn.arg_names:
            if arg in constexprs:
                signature[arg] = "constexpr"
            elif arg.endswith("_ptr"):
                signature[arg] = pointers.get(arg, "*" + dtype)
            else:
                signature[arg] = "fp32" if arg in _FLOATS else "i32"
        ctx = libtriton.ir.context()
        libtriton.ir.load_dialects(ctx)
        backend.load_dialects(ctx)
        src = ASTSource(fn=fn, constexprs=constexprs, signature=signature)
        ir = str(src.make_ir(target, options, backend.get_codegen_implementation(options), backend.get_module_map(),
                             ctx))
        assert "tt.func" in ir and "tt.store" in ir, name
        compiled.add(name)
    # every kernel is compiled, directly or inlined into one that is (helpers such as _rotate_half,
    # and the helpers they call)
    covered = set(compiled)
    while more := {n for n in kernels if n not in covered and any(n + "(" in kernels[k].src for k in covered)}:
        covered |= more
    missing = set(kernels) - covered
    assert not missing, f"kernels without a compile case: {sorted(missing)}"
    print("compiled", len(compiled), "kernels")


def test_every_triton_kernel_compiles():
    pytest.importorskip("triton.backends.nvidia.compiler")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "compiled 23 kernels" in proc.stdout, proc.stderr[-3000:]


if __name__ == "__main__":
    _compile_all()
