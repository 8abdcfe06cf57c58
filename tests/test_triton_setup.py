"""expresslane.triton_setup's changes to Triton's interpreter (the CPU path of every kernel test)."""

import pytest

from expresslane.triton_setup import INTERPRETED, tl, triton


@triton.jit
def _scaled_index_kernel(out_ptr, n, stride, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(out_ptr + i, i * stride + n, mask=i < n)


@pytest.mark.skipif(not INTERPRETED, reason="the interpreter's settings (TRITON_INTERPRET=1)")
def test_integer_overflow_checks_are_off_as_in_compiled_kernels_without_debug():
    """The interpreter skips the int64 overflow check of integer ops, whose assert compiled kernels
    (and the interpreter) run only with debug; integer arithmetic is unchanged."""
    import torch
    from triton.runtime import interpreter

    options = interpreter.interpreter_builder.options
    assert not options.debug and not options.sanitize_overflow
    out = torch.zeros(16, dtype=torch.int32)
    _scaled_index_kernel[(1,)](out, 13, 7, BLOCK=16)
    assert out.tolist() == [i * 7 + 13 for i in range(13)] + [0, 0, 0]
