"""Scalar arithmetic shared by the CPU and CUDA kernels: the hash RNG and the 16-bit grids.

Written once as plain Python and compiled for each target by :func:`build`, so the CPU and
CUDA kernels run the same operations in the same order and produce the same bytes. All
integer arithmetic stays below 2**63 (no overflow in int64, NumPy scalars or Python ints),
and all metadata arithmetic is float64 with exact powers of two (floor, frexp, ldexp), so the
results do not depend on the target.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from types import SimpleNamespace

import numpy as np

MASK32 = 0xFFFFFFFF
#: The two odd multipliers of the 32-bit mixer; both below 2**31 so products fit in int64.
MUL1 = 0x7FEB352D
MUL2 = 0x2C1B3C6D
#: Added to the high word of the index before it is hashed into the key.
GOLDEN = 0x9E3779B9
#: 2**-24: a 24-bit random integer times this is uniform on [0, 1) with exact float32 steps.
INV_2_24 = 1.0 / 16777216.0

# (significant bits including the implicit one, exponent bias, explicit mantissa bits,
#  exponent of the smallest subnormal) of the two 16-bit grids.
FP16 = (11, 15, 10, -24)
BF16 = (8, 127, 7, -133)
FP16_MAX_ABS = 16384.0  # beyond this (or for steps too fine for float16) a group uses bfloat16
FP16_MIN_SCALE = 2.0**-14  # smallest normal float16: finer steps would lose precision
BF16_MAX_ABS = 2.0**126  # beyond this the group is invalid (dequantizes to NaN)
BF16_MIN_SCALE = 2.0**-100  # a smallest non-zero step, so 1 / scale stays finite in float32
BF16_TINY = 2.0**-133  # smallest positive bfloat16: lo of zero-code groups never rounds to 0


def _mix32(x):
    """A bijective 32-bit integer mixer (xorshift-multiply rounds)."""
    x = x & MASK32
    x ^= x >> 16
    x = (x * MUL1) & MASK32
    x ^= x >> 15
    x = (x * MUL2) & MASK32
    x ^= x >> 16
    return x


def random24_u32(key, index):
    """:func:`random24 <build>` of a uint32 ``key`` and ``index`` in 32-bit unsigned arithmetic
    (for compiled code: every product and shift stays in one 32-bit register; the low 32 bits
    of a product do not depend on the width it is computed in, so the bits are the same)."""
    x = np.uint32(np.uint32(index) ^ np.uint32(key))
    x = np.uint32(x ^ (x >> np.uint32(16)))
    x = np.uint32(x * np.uint32(MUL1))
    x = np.uint32(x ^ (x >> np.uint32(15)))
    x = np.uint32(x * np.uint32(MUL2))
    x = np.uint32(x ^ (x >> np.uint32(16)))
    return np.int32(x >> np.uint32(8))


def _frexp_exponent(a):
    """``math.frexp(a)[1]``."""
    return math.frexp(a)[1]


def _ldexp(a, e):
    return math.ldexp(a, e)


def build(jit: Callable, exponent: Callable | None = None,
          ldexp: Callable | None = None) -> SimpleNamespace:
    """Compile the shared scalar functions with ``jit`` (``numba.njit`` or a CUDA device jit).

    ``exponent`` (``math.frexp(a)[1]`` of a finite non-zero float) and ``ldexp`` may be
    given as faster compiled equivalents; both are exact functions, so the results do not
    change."""
    mix32 = jit(_mix32)
    exponent = exponent or jit(_frexp_exponent)
    ldexp = ldexp or jit(_ldexp)

    @jit
    def stream_key(seed, hi):
        """Key of the 2**32-element block ``hi`` of the random stream ``seed``."""
        return mix32(seed ^ mix32(hi + GOLDEN))

    @jit
    def random24(key, index):
        """24 random bits for element ``index`` (only its low 32 bits are used here)."""
        return mix32((index & MASK32) ^ key) >> 8

    @jit
    def to_grid(v, prec, sub, up):
        """``v`` rounded down (or up) onto a 16-bit grid: (float64 value, its 16 bits).

        The grid has ``prec`` significant bits and smallest spacing 2**``sub``. A value on it
        is ``n * 2**E`` with integer ``n`` (implicit bit included) and spacing exponent ``E``,
        and its bits are ``(E - sub) << (prec - 1)) + n`` (this also covers subnormals and a
        carry into the next binade), plus the sign bit.
        """
        if v == 0.0:
            return 0.0, 0
        a = abs(v)
        e = max(exponent(a) - prec, sub)
        q = ldexp(a, -e)
        # magnitude rounded away from zero when rounding up a positive or down a negative v;
        # int(): math.floor and math.ceil return floats on CUDA
        n = int(math.ceil(q)) if (v > 0.0) == up else int(math.floor(q))  # noqa: RUF046
        if n == 0:
            return 0.0, 0
        value = ldexp(float(n), e)
        word = ((e - sub) << (prec - 1)) + n
        if v < 0.0:
            return -value, word | 0x8000
        return value, word

    @jit
    def decode16(word, prec, sub):
        """The float64 value of 16 bits on a grid (NaN for the all-ones exponent)."""
        word = int(word)
        mbits = prec - 1
        top = (1 << (15 - mbits)) - 1
        field = (word >> mbits) & top
        n = word & ((1 << mbits) - 1)
        if field == top:
            return math.nan
        if field:
            n += 1 << mbits
            field -= 1
        value = ldexp(float(n), sub + field)
        return -value if word & 0x8000 else value

    @jit
    def fit(mn, mx, levels, prec, sub):
        """lo rounded down and scale rounded up on one grid so that lo + levels*scale >= mx."""
        lo, lo_word = to_grid(mn, prec, sub, False)
        scale, scale_word = to_grid((mx - lo) / levels, prec, sub, True)
        # levels * scale is exact in float64 (8 + 11 significant bits), so this test gives the
        # same answer whether or not a compiler fuses it into an FMA
        while lo + levels * scale < mx:  # the division rounded below: next grid value up
            scale, scale_word = to_grid(scale + max(scale * 2.0**-prec, 2.0**sub), prec, sub,
                                        True)
        return lo, lo_word, scale, scale_word

    @jit
    def group_meta(mn, mx, levels, zero_code):
        """(lo word, scale word, lo, scale) of a group with float64 min ``mn``, max ``mx``.

        With ``zero_code`` (code 0 is an exact zero), ``mn`` is the smallest positive value
        (+inf if none), ``levels`` counts the steps above ``lo`` and ``lo`` is kept positive.
        """
        if zero_code and mn > mx:  # no positive value: every code is 0
            return 0, 0, 0.0, 0.0
        big = max(abs(mn), abs(mx))
        if not big <= BF16_MAX_ABS:  # also catches NaN and inf
            return 0x7E00, 0, math.nan, 0.0
        if big <= FP16_MAX_ABS:
            lo, lo_word, scale, scale_word = fit(mn, mx, levels, FP16[0], FP16[3])
            if (scale == 0.0 or scale >= FP16_MIN_SCALE) and (lo > 0.0 or not zero_code):
                return lo_word, scale_word, lo, scale
        if zero_code:
            mn = max(mn, BF16_TINY)
            mx = max(mx, mn)
        lo, lo_word, scale, scale_word = fit(mn, mx, levels, BF16[0], BF16[3])
        if 0.0 < scale < BF16_MIN_SCALE:
            scale, scale_word = to_grid(BF16_MIN_SCALE, BF16[0], BF16[3], True)
        return lo_word, 0x8000 | scale_word, lo, scale

    @jit
    def meta_values(lo_word, scale_word):
        """Decode the two metadata words of a group into float64 (lo, scale)."""
        scale_word = int(scale_word)
        if scale_word & 0x8000:
            return (decode16(lo_word, BF16[0], BF16[3]),
                    decode16(scale_word & 0x7FFF, BF16[0], BF16[3]))
        return decode16(lo_word, FP16[0], FP16[3]), decode16(scale_word, FP16[0], FP16[3])

    return SimpleNamespace(
        mix32=mix32,
        stream_key=stream_key,
        random24=random24,
        to_grid=to_grid,
        decode16=decode16,
        group_meta=group_meta,
        meta_values=meta_values,
    )
