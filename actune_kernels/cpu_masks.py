"""Numba CPU kernel for dropout's keep masks, drawn from the packed format's random stream.

Element ``i`` of the mask for ``seed`` is kept when its 24 random bits (the stream that
stochastic rounding uses, :func:`actune_kernels.reference.random24`) fall below
``threshold = round(keep * 2**24)``: a Bernoulli(keep) draw whose probability is exact to
2**-24. The mask is a pure function of ``seed`` and the index, so a backward pass regenerates
it instead of storing it, and each parallel task draws its own part with no shared state.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import prange

from .cpu import _pointer
from .cpu_scalar import SCALAR, random24_u32
from .scalar import MASK32

_stream_key = SCALAR.stream_key
_U32 = np.uint32
#: Elements a parallel task draws (a power of two: a block never crosses a 2**32 boundary of
#: the stream's index).
_BLOCK = 1 << 16
#: Under this many elements the calling thread draws the mask alone.
SERIAL_MASK = 1 << 15


@numba.njit(inline="always")
def _draw(out, start, stop, seed, threshold):  # pragma: no cover - jitted
    key = _U32(_stream_key(seed, start >> 32))
    low = _U32(start & MASK32)
    t = np.int32(threshold)
    for i in range(stop - start):
        out[start + i] = np.uint8(random24_u32(key, _U32(low + _U32(i))) < t)


@numba.njit(parallel=True, cache=True, nogil=True)
def _keep(out_at, n, seed, threshold):  # pragma: no cover - jitted
    out = numba.carray(_pointer(out_at, np.uint8(0)), n)
    for c in prange((n + _BLOCK - 1) // _BLOCK):
        start = c * _BLOCK
        _draw(out, start, min(start + _BLOCK, n), seed, threshold)


@numba.njit(cache=True, nogil=True)
def _keep_serial(out_at, n, seed, threshold):  # pragma: no cover - jitted
    out = numba.carray(_pointer(out_at, np.uint8(0)), n)
    for c in range((n + _BLOCK - 1) // _BLOCK):
        start = c * _BLOCK
        _draw(out, start, min(start + _BLOCK, n), seed, threshold)


def threshold_of(keep: float) -> int:
    """The 24-bit threshold of a keep probability in [0, 1]."""
    if not 0.0 <= keep <= 1.0:
        raise ValueError(f"keep probability must be in [0, 1], got {keep!r}")
    return round(keep * (1 << 24))


def keep_mask_at(out_at: int, n: int, seed: int, keep: float) -> None:
    """Fill the ``n`` bytes at ``out_at`` with 1 (kept) or 0 (dropped), element ``i`` drawn
    from the stream ``seed`` at index ``i``. The caller vouches for the buffer (as
    :func:`actune_kernels.cpu.pack_at`)."""
    if n:
        kernel = _keep if n >= SERIAL_MASK else _keep_serial
        kernel(out_at, n, seed, threshold_of(keep))


def keep_mask(out: np.ndarray, seed: int, keep: float) -> None:
    """:func:`keep_mask_at` of a C-contiguous one-byte array (uint8 or bool)."""
    if out.itemsize != 1 or not out.flags.c_contiguous:
        raise ValueError(f"expected a C-contiguous array of one-byte items, got {out.dtype} "
                         f"with strides {out.strides}")
    keep_mask_at(out.ctypes.data, out.size, seed, keep)
