"""Triton for every kernel module, which import it from here: under Triton's interpreter
(TRITON_INTERPRET=1: CPU, tests, `attention_bench.py --smoke`) with a fix applied first.

Triton 3.6's interpreter keeps scalars as shape-(1,) arrays and turns them into loop bounds
with int(), which numpy >= 2.4 refuses ("only 0-dimensional arrays can be converted"); the fix
takes the element instead. Compiled kernels (CUDA) are untouched.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl


def _fix_interpreter() -> None:
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "expresslane_fixed", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched.expresslane_fixed = True
    interpreter._patch_lang_tensor = patched


if os.environ.get("TRITON_INTERPRET") == "1":
    _fix_interpreter()

__all__ = ["triton", "tl"]
