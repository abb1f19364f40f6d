"""Scalar pieces of the CPU kernels, compiled inline for Numba's CPU target.

The shared scalar arithmetic (:mod:`actune_kernels.scalar`) with its powers of two taken from
the float's exponent field, and the random stream's mixer emitted in 32-bit operations: the
same results as the general versions, in instructions that vectorize.
"""

from __future__ import annotations

import math

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from .scalar import MUL1, MUL2, build

_inline = numba.njit(inline="always")


@_inline
def exponent(a):  # pragma: no cover - jitted
    """``math.frexp(a)[1]`` of a finite non-zero float64, from its exponent field."""
    field = (np.float64(a).view(np.int64) >> 52) & 0x7FF
    if field == 0:  # subnormal
        return math.frexp(a)[1]
    return field - 1022


@_inline
def ldexp(a, e):  # pragma: no cover - jitted
    """``math.ldexp(a, e)``: ``a`` times an exact power of two (IEEE products round
    correctly, as ldexp does)."""
    if -1022 <= e <= 1023:
        return a * np.int64((e + 1023) << 52).view(np.float64)
    return math.ldexp(a, e)


SCALAR = build(_inline, exponent, ldexp)

_U32 = np.uint32
_S8 = _U32(8)


@intrinsic
def mix32_i32(typingctx, x):
    """:func:`scalar._mix32` of a uint32, emitted as 32-bit LLVM operations (the same bits)."""
    if x != types.uint32:
        return None

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        v = args[0]
        for shift, mul in ((16, MUL1), (15, MUL2)):
            v = builder.xor(v, builder.lshr(v, ir.Constant(i32, shift)))
            v = builder.mul(v, ir.Constant(i32, mul))
        return builder.xor(v, builder.lshr(v, ir.Constant(i32, 16)))

    return types.uint32(types.uint32), codegen


@_inline
def random24_u32(key, index):  # pragma: no cover - jitted
    """:func:`scalar.random24` for uint32 ``key`` and ``index``, as int32 (exactly converted
    to float: 24 bits)."""
    return np.int32(mix32_i32(_U32(index ^ key)) >> _S8)


@_inline
def order_key(w, magnitude):  # pragma: no cover - jitted
    """Signed integer with the order of the float whose bits are ``w`` (an involution):
    negative floats' magnitude bits flipped. A select, not a shift by the sign, so it stays
    in 32-bit lanes for float32 once the caller casts it back."""
    return w ^ magnitude if w < 0 else w
