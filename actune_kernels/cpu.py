"""Numba CPU kernels: parallel over groups, one pass over the input (the loops themselves:
:mod:`.cpu_groups`), on buffers given by address or as arrays.

Tensors under ``SERIAL_PACK`` / ``SERIAL_UNPACK`` elements run on the calling thread alone.
"""

from __future__ import annotations

import types

import numba
import numpy as np
from numba import prange
from numba.extending import intrinsic

from .cpu_groups import _BITS, _CHUNK, _groups_at
from .cpu_scalar import SCALAR

_meta_values = SCALAR.meta_values


@numba.njit(inline="always")
def _pack_groups(x, words, magnitude, inf_key, codes, meta, bits, group_size, seed, base,
                 stochastic, zero_code):  # pragma: no cover - jitted
    groups = meta.shape[0]
    group_bytes = group_size * bits // 8
    for c in prange((groups + _CHUNK - 1) // _CHUNK):
        first = c * _CHUNK
        start = first * group_size
        _groups_at(bits, x, words, first, min(first + _CHUNK, groups), start, group_size,
                   codes, first * group_bytes, meta, magnitude, inf_key, seed, base + start,
                   stochastic, zero_code)


@intrinsic
def _pointer(typingctx, address, like):
    """The integer ``address`` as a pointer to values of ``like``'s type (a scalar)."""
    if not isinstance(address, numba.types.Integer) or not isinstance(like, numba.types.Number):
        return None

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(signature.return_type))

    return numba.types.CPointer(like)(address, like), codegen


@numba.njit(inline="always")
def _buffers(codes_at, meta_at, n, bits, group_size):  # pragma: no cover - jitted
    """The codes (uint8) and metadata (uint16 [G, 2]) of ``n`` values, at these addresses."""
    groups = (n + group_size - 1) // group_size
    codes = numba.carray(_pointer(codes_at, np.uint8(0)), groups * (group_size * bits // 8))
    return codes, numba.carray(_pointer(meta_at, np.uint16(0)), (groups, 2))


@numba.njit(parallel=True, cache=True, nogil=True)
def _pack(x_at, n, like, magnitude, inf_key, codes_at, meta_at, bits, group_size, seed, base,
          stochastic, zero_code):  # pragma: no cover - jitted
    codes, meta = _buffers(codes_at, meta_at, n, bits, group_size)
    _pack_groups(numba.carray(_pointer(x_at, like), n), numba.carray(_pointer(x_at, magnitude), n),
                 magnitude, inf_key, codes, meta, bits, group_size, seed, base, stochastic,
                 zero_code)


@numba.njit(inline="always")
def _value(q, lo, scale, zero_code, t):  # pragma: no cover - jitted
    """lo + code * scale; in zero-code mode code 0 is 0 and code c > 0 is lo + (c - 1) scale."""
    if zero_code:
        return lo + t(q - 1) * scale if q else t(0)
    return lo + t(q) * scale


@numba.njit(cache=True, nogil=True)
def _unpack_bytes(src, ys, lo, scale, zero_code, mask, per, bits):  # pragma: no cover
    t = ys.dtype.type
    for k in range(src.size):
        byte = src[k]
        for j in range(per):
            ys[k * per + j] = _value((byte >> (bits * j)) & mask, lo, scale, zero_code, t)


@numba.njit(inline="always")
def _unpack_group(src, ys, lo, scale, zero_code, bits):  # pragma: no cover - jitted
    """A whole group's values, with the byte loop specialised per width."""
    if bits == 1:
        _unpack_bytes(src, ys, lo, scale, zero_code, 1, 8, 1)
    elif bits == 2:
        _unpack_bytes(src, ys, lo, scale, zero_code, 3, 4, 2)
    elif bits == 4:
        _unpack_bytes(src, ys, lo, scale, zero_code, 15, 2, 4)
    else:
        _unpack_bytes(src, ys, lo, scale, zero_code, 255, 1, 8)


@numba.njit(inline="always")
def _unpack_groups(codes, meta, bits, group_size, zero_code, y):  # pragma: no cover - jitted
    n = y.size
    t = y.dtype.type
    per = 8 // bits
    mask = (1 << bits) - 1
    group_bytes = group_size * bits // 8
    for g in prange(meta.shape[0]):
        lo64, scale64 = _meta_values(meta[g, 0], meta[g, 1])
        lo = t(lo64)
        scale = t(scale64)
        start = g * group_size
        ys = y[start:min(start + group_size, n)]
        src = codes[g * group_bytes:(g + 1) * group_bytes]
        if ys.size < group_size:
            for i in range(ys.size):
                q = (src[i // per] >> ((i % per) * bits)) & mask
                ys[i] = _value(q, lo, scale, zero_code, t)
        else:
            _unpack_group(src, ys, lo, scale, zero_code, bits)


@numba.njit(parallel=True, cache=True, nogil=True)
def _unpack(codes_at, meta_at, bits, group_size, zero_code, out_at, n,
            like):  # pragma: no cover - jitted
    codes, meta = _buffers(codes_at, meta_at, n, bits, group_size)
    _unpack_groups(codes, meta, bits, group_size, zero_code,
                   numba.carray(_pointer(out_at, like), n))


def _serial(kernel):
    """``kernel`` compiled without the thread pool, under its own name: Numba's on-disk cache
    is keyed by a function's name, not by ``parallel``, so a copy of the same function under
    the same name would load the other's machine code."""
    f = kernel.py_func
    copy = types.FunctionType(f.__code__, f.__globals__, f.__name__ + "_serial",
                              f.__defaults__, f.__closure__)
    copy.__qualname__ = f.__qualname__ + "_serial"
    return numba.njit(cache=True, nogil=True)(copy)


#: The same kernels on the calling thread alone, for tensors under these sizes: there waking
#: the thread pool costs more than it saves (docs/benchmarks.md, "Kernels").
_pack_serial = _serial(_pack)
_unpack_serial = _serial(_unpack)
SERIAL_PACK = 8192
SERIAL_UNPACK = 16384


#: Per kernel dtype, a scalar of it: its pointers' element type in :func:`_pointer`.
_LIKE = {np.dtype(np.float32): np.float32(0), np.dtype(np.float64): np.float64(0)}
_U8, _U16 = np.dtype(np.uint8), np.dtype(np.uint16)


def pack_at(x_at: int, n: int, dtype: np.dtype, codes_at: int, meta_at: int, bits: int,
            group_size: int, seed: int, base: int = 0, stochastic: bool = True,
            zero_code: bool = False) -> None:
    """:func:`pack` of buffers given by address: the ``n`` values of ``dtype`` at ``x_at``,
    the codes at ``codes_at``, the metadata at ``meta_at``. For callers whose buffers are not
    arrays (torch tensors): making an array of one costs about as much as allocating it, ten
    times reading its address (docs/benchmarks.md). The caller vouches for every address:
    contiguous, aligned, large enough, alive and written by nothing else during the call."""
    if n:
        _, magnitude, inf_key = _BITS[dtype]
        kernel = _pack if n >= SERIAL_PACK else _pack_serial
        kernel(x_at, n, _LIKE[dtype], magnitude, inf_key, codes_at, meta_at, bits, group_size,
               seed, base, bool(stochastic), bool(zero_code))


def unpack_at(codes_at: int, meta_at: int, bits: int, group_size: int, out_at: int, n: int,
              dtype: np.dtype, zero_code: bool = False) -> None:
    """:func:`unpack` of buffers given by address (as :func:`pack_at`): the ``n`` values of
    ``dtype`` at ``out_at``."""
    if n:
        kernel = _unpack if n >= SERIAL_UNPACK else _unpack_serial
        kernel(codes_at, meta_at, bits, group_size, bool(zero_code), out_at, n, _LIKE[dtype])


def _address(a: np.ndarray, dtype=None) -> int:
    """A C-contiguous array's address (of ``dtype``'s item size if given)."""
    if not a.flags.c_contiguous or (dtype is not None and a.dtype.itemsize != dtype.itemsize):
        raise ValueError(f"expected a C-contiguous array of {dtype or a.dtype}, got {a.dtype} "
                         f"with strides {a.strides}")
    return a.ctypes.data


def pack(x: np.ndarray, codes: np.ndarray, meta: np.ndarray, bits: int, group_size: int,
         seed: int, base: int = 0, stochastic: bool = True, zero_code: bool = False) -> None:
    """Fill ``codes`` (uint8) and ``meta`` (uint16 [G, 2]) from 1-D float32/float64 ``x``.

    ``base`` is the index of ``x[0]`` in the random stream ``seed``; ``zero_code`` reserves
    code 0 for exact zeros (for tensors >= 0, such as ReLU outputs; bits >= 2).
    """
    if x.size:
        x = np.ascontiguousarray(x)
        pack_at(x.ctypes.data, x.size, x.dtype, _address(codes, _U8), _address(meta, _U16),
                bits, group_size, seed, base, stochastic, zero_code)


def unpack(codes: np.ndarray, meta: np.ndarray, bits: int, group_size: int,
           out: np.ndarray, zero_code: bool = False) -> None:
    """Fill 1-D float32/float64 ``out`` from ``codes`` and ``meta``."""
    if out.size:
        unpack_at(_address(codes, _U8), _address(meta, _U16), bits, group_size, _address(out),
                  out.size, out.dtype, zero_code)
