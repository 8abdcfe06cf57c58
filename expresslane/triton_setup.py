"""Triton for every kernel module, which import it from here: under Triton's interpreter
(TRITON_INTERPRET=1: CPU, tests, `attention_bench.py --smoke`) with three changes applied first.
Compiled kernels (CUDA) are untouched.

- Triton 3.6's interpreter keeps scalars as shape-(1,) arrays and turns them into loop bounds
  with int(), which numpy >= 2.4 refuses ("only 0-dimensional arrays can be converted"); the
  fix takes the element instead.
- It patches triton.language for the interpreter at every call of a @triton.jit helper, walking
  the language's modules with inspect.getmembers each time: about a fifth of an interpreted
  engine step, where helpers run once per program. Within one launch a helper's patches are the
  ones already in place (the same modules, the same builder), so each module set is patched once
  a launch; the launch's own patches are restored after it as before.
- Its integer adds, subtracts and multiplies each compute an int64 overflow check
  (`sanitize_overflow`, on by default) whose assert then runs only with `debug`, as in compiled
  kernels: without `debug` the check is work for nothing, about half of an interpreted attention
  program's time, so it is turned off (left on with `debug`).

The interpreter runs a launch's programs one after another, each op a numpy call on the
program's block, so its cost follows the number of programs, not their size. Kernels with one
program per token or row take `rows_per_program(n)` rows each: 1 when compiled (the GPU's grid
as designed), all of them (up to a cap) when interpreted.
"""

from __future__ import annotations

import dataclasses
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

    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if options is not None and not options.debug and getattr(options, "sanitize_overflow", False):
        builder.options = dataclasses.replace(options, sanitize_overflow=False)

    if not (hasattr(interpreter, "_patch_lang") and hasattr(interpreter, "GridExecutor")):
        return  # another Triton's interpreter: left as it is (slower, not wrong)
    patch_lang, launch = interpreter._patch_lang, interpreter.GridExecutor.__call__
    patched_now: set[tuple[int, ...]] = set()  # the module sets patched in the current launch

    def patch_lang_once(fn):
        langs = tuple(sorted(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core))
        if langs in patched_now:
            return interpreter._LangPatchScope()
        patched_now.add(langs)
        return patch_lang(fn)

    def launch_patching_once(self, *args, **kwargs):
        patched_now.clear()
        try:
            return launch(self, *args, **kwargs)
        finally:
            patched_now.clear()

    interpreter._patch_lang = patch_lang_once
    interpreter.GridExecutor.__call__ = launch_patching_once


INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
INTERPRETED_ROWS_CAP = 128  # rows of one interpreted program: bounds its numpy blocks


def rows_per_program(rows: int) -> int:
    """How many of `rows` tokens or rows one program of a per-row kernel takes (a power of 2)."""
    if not INTERPRETED:
        return 1
    return min(triton.next_power_of_2(max(rows, 1)), INTERPRETED_ROWS_CAP)


if INTERPRETED:
    _fix_interpreter()

__all__ = ["triton", "tl", "rows_per_program"]
