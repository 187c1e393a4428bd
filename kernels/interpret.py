"""Two gaps of Triton's CPU interpreter (the tests) with bf16, shared by the kernels that
multiply tiles: numpy has no bf16, so the interpreter multiplies bf16 tiles as their raw
uint16 bits, and it rounds float32 -> bf16 toward zero (GPUs round to nearest even).
There `dot` widens both tiles to float32 first (exact; the accumulation is float32 either
way) and `cast` rounds to nearest even by hand. Compiled kernels take the native dot and
cast. INTERPRET is also what kernels with inline PTX branch on: the interpreter runs none."""
from __future__ import annotations

import os

import triton
import triton.language as tl

INTERPRET_ENV = os.environ.get("TRITON_INTERPRET", "0") == "1"
INTERPRET = tl.constexpr(INTERPRET_ENV)


@triton.jit
def dot(a, b, acc, PRECISION: tl.constexpr):
    if INTERPRET:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def cast(x, dt: tl.constexpr, RNE_BF16: tl.constexpr):
    """float32 x -> dt. RNE_BF16 (interpreter, bf16 only): round the float32 bits to the
    nearest even bf16 first, so that the interpreter's truncating cast is exact."""
    if RNE_BF16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dt)
