"""The Triton compiler's front end (Python AST -> TTIR) on CPU, for kernels whose code
the interpreter runs but does not type-check: e.g. a variable redefined with another
shape inside an `if` runs in the interpreter and fails to compile on a GPU. Runs in a
subprocess, because the test session imports the kernels in interpreter mode."""

import os
import subprocess
import sys

import pytest


def _compile_all() -> None:
    from triton._C import libtriton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.compiler import ASTSource

    from expresslane.attention import triton_kernels

    target = GPUTarget("cuda", 90, 32)  # H100/H200
    backend = CUDABackend(target)
    options = backend.parse_options({})
    pow2 = lambda n: 1 << (n - 1).bit_length()  # noqa: E731
    strides = ["stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_vt", "stride_vh", "stride_cs",
               "stride_c_kv", "stride_c_slot", "stride_c_head"]
    signature = {**dict.fromkeys(["q_ptr", "k_ptr", "v_ptr"], "*bf16"), "pos_ptr": "*i64", "slot_ptr": "*i64",
                 "cos_sin_ptr": "*fp32", "q_out_ptr": "*bf16", "cache_ptr": "*bf16", **dict.fromkeys(strides, "i32"),
                 "k_scale": "fp32", "v_scale": "fp32"}
    for heads, kv_heads, kv_fp8 in ((32, 8, False), (14, 2, False), (4, 1, False), (32, 8, True)):
        constexprs = {"HQ": heads, "HK": kv_heads, "HALF": 64, "HQ_PAD": pow2(heads), "HK_PAD": pow2(kv_heads),
                      "HALF_PAD": 64, "KV_FP8": kv_fp8}
        signature["cache_ptr"] = "*fp8e4nv" if kv_fp8 else "*bf16"
        ctx = libtriton.ir.context()
        libtriton.ir.load_dialects(ctx)
        backend.load_dialects(ctx)
        src = ASTSource(fn=triton_kernels.rope_store_kernel, constexprs=constexprs,
                        signature={**signature, **dict.fromkeys(constexprs, "constexpr")})
        ir = str(src.make_ir(target, options, backend.get_codegen_implementation(options),
                             backend.get_module_map(), ctx))
        assert "tt.func" in ir and "tt.store" in ir
    print("compiled")


def test_rope_store_kernel_compiles():
    pytest.importorskip("triton.backends.nvidia.compiler")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-3000:]


if __name__ == "__main__":
    _compile_all()
