"""The PTX that decodes eight e2m1 codes on CUDA (fused_moe._E2M1_WORD_PTX), run on CPU by a small
interpreter of the instructions it uses (prmt, shl, and, or, mov, cvt.f32.f16): every code of many
words equals the reference table's value / 2^14, the kernel's convention. The GPU tests run the
same string through ptxas and the one-row tiles."""

import random
import re

import numpy as np
import pytest

fused_moe = pytest.importorskip("expresslane.layers.fused_moe")

from expresslane.quant.mxfp4 import e2m1_values  # noqa: E402

MASK = 0xFFFFFFFF


def _prmt(a: int, b: int, selector: int) -> int:
    """PTX prmt.b32 (default mode): byte i of the result is byte (nibble i of selector) of {b, a};
    a nibble with its top bit set replicates that byte's sign bit."""
    src = [(a >> 8 * i) & 0xFF for i in range(4)] + [(b >> 8 * i) & 0xFF for i in range(4)]
    out = 0
    for i in range(4):
        sel = (selector >> 4 * i) & 0xF
        byte = src[sel & 7]
        if sel & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << 8 * i
    return out


def _run(ptx: str, word: int) -> list[float]:
    """The asm's outputs $0..$7 for input $8 = word."""
    regs, halves, out = {"$8": word}, {}, {}
    value = lambda x: regs[x] if x in regs else int(x, 0)  # noqa: E731
    body = ptx.strip().removeprefix("{").removesuffix("}")
    for ins in filter(None, (s.strip() for s in body.split(";"))):
        op, args = ins.split(None, 1)
        args = [a.strip() for a in re.split(r",(?![^{]*})", args)]
        if op.startswith(".reg"):
            continue
        if op == "mov.b32" and args[0].startswith("{"):  # unpack a word into two halves
            lo, hi = (h.strip() for h in args[0].strip("{}").split(","))
            halves[lo], halves[hi] = value(args[1]) & 0xFFFF, value(args[1]) >> 16
        elif op == "mov.b32":
            regs[args[0]] = value(args[1])
        elif op == "prmt.b32":
            regs[args[0]] = _prmt(value(args[1]), value(args[2]), value(args[3]))
        elif op == "shl.b32":
            regs[args[0]] = (value(args[1]) << value(args[2])) & MASK
        elif op == "and.b32":
            regs[args[0]] = value(args[1]) & value(args[2])
        elif op == "or.b32":
            regs[args[0]] = value(args[1]) | value(args[2])
        elif op == "cvt.f32.f16":
            out[args[0]] = float(np.array([halves[args[1]]], dtype=np.uint16).view(np.float16)[0])
        else:
            raise AssertionError(f"the interpreter does not know {op}")
    return [out[f"${i}"] for i in range(8)]


def test_e2m1_word_ptx_decodes_every_code():
    table = e2m1_values(__import__("torch").float32, "cpu").tolist()  # codes 0..15, sign in bit 3
    rng = random.Random(0)
    words = [rng.getrandbits(32) for _ in range(3000)] + [0, MASK, 0x88888888, 0x76543210, 0xFEDCBA98]
    for word in words:
        got = _run(fused_moe._E2M1_WORD_PTX.value, word)
        want = [table[(word >> 4 * i) & 0xF] / 2 ** 14 for i in range(8)]
        assert got == want, (hex(word), got, want)
