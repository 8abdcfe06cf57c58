"""The quantized-linear Triton kernels through the compiler's front end (AST -> TTIR) for
an H100/H200 target, as tests/test_triton_compile.py does for attention: the interpreter
runs code the compiler may refuse (types, shapes). In a subprocess without TRITON_INTERPRET."""

import os
import subprocess
import sys

import pytest


def _compile_all() -> None:
    from triton._C import libtriton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.compiler import ASTSource

    from expresslane.quant import kernels

    target = GPUTarget("cuda", 90, 32)
    backend = CUDABackend(target)
    options = backend.parse_options({})

    def compile_ir(fn, signature, constexprs) -> str:
        ctx = libtriton.ir.context()
        libtriton.ir.load_dialects(ctx)
        backend.load_dialects(ctx)
        src = ASTSource(fn=fn, constexprs=constexprs, signature={**signature, **dict.fromkeys(constexprs, "constexpr")})
        return str(src.make_ir(target, options, backend.get_codegen_implementation(options), backend.get_module_map(),
                               ctx))

    ints = dict.fromkeys(["M", "N", "K", "stride_xm", "stride_om"], "i32")
    for act in ("bf16", "fp16"):
        for fp8 in (True, False):
            signature = {"x_ptr": f"*{act}", "w_ptr": "*fp8e4nv" if fp8 else "*i32",
                         "scale_ptr": "*fp32" if fp8 else "*fp16", "zero_ptr": "*u8", "bias_ptr": f"*{act}",
                         "out_ptr": f"*{act}", **ints}
            for m in (1, 64, 4096):
                bm, bn, bk, _ = kernels._tiles(m, None if fp8 else 128)
                ir = compile_ir(kernels.quant_gemm_kernel, signature, {
                    "FP8": fp8, "GROUP": 1 if fp8 else 128, "HAS_BIAS": m == 64, "PRECISION": "tf32",
                    "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk})
                assert "tt.dot" in ir and "tt.store" in ir
        ir = compile_ir(kernels.per_token_quant_fp8_kernel,
                        {"x_ptr": f"*{act}", "q_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "K": "i32",
                         "stride_xm": "i32"}, {"BLOCK": 4096, "ONE_PASS": False})
        assert "tt.store" in ir
    from expresslane.attention import triton_kernels

    ptrs = {"q_ptr": "*bf16", "k_cache_ptr": "*fp8e4nv", "v_cache_ptr": "*fp8e4nv", "out_ptr": "*bf16",
            "part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32", "count_ptr": "*i32", "block_tables_ptr": "*i32",
            "seq_lens_ptr": "*i32",
            "query_start_loc_ptr": "*i32", "work_ptr": "*i32", "sinks_ptr": "*bf16"}
    scalars = {"scale": "fp32", "num_splits": "i32", "k_scale": "fp32", "v_scale": "fp32", "softcap": "fp32",
               "window": "i32"}
    strides = dict.fromkeys(["stride_qt", "stride_qh", "stride_kb", "stride_ks", "stride_kh", "stride_ot",
                             "stride_oh", "stride_bt", "stride_pa_s", "stride_pa_p", "stride_pa_t", "stride_pa_h",
                             "stride_ml_s", "stride_ml_p", "stride_ml_t", "stride_ml_h"], "i32")
    for decode in (True, False):
        ir = compile_ir(triton_kernels.paged_attention_kernel, {**ptrs, **scalars, **strides}, {
            "G": 4, "G_PAD": 4, "HK": 8, "BLOCK_Q": 4 if decode else 16, "BLOCK_N": 64, "HEAD_DIM": 128, "D_PAD": 128,
            "PAGE": 16, "DECODE": decode, "MASK_ALL": False, "FUSED_REDUCE": decode, "PRECISION": "tf32",
            "SOFTCAP": False, "HAS_WINDOW": False, "HAS_SINKS": False})
        assert "tt.dot" in ir
    print("compiled")


def test_quant_kernels_compile():
    pytest.importorskip("triton.backends.nvidia.compiler")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-3000:]


if __name__ == "__main__":
    _compile_all()
