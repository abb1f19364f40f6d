"""Numba CPU kernels: parallel over groups, one pass over the input.

Each group is read into cache once for its min and max, then quantized while it is still there:
one code a byte into a scratch buffer in a unit-stride loop, then joined into whole bytes a
word at a time. The loops are written so that LLVM vectorizes them with AVX2 as with AVX-512:

- every value stays in 32-bit lanes for float32 (Numba widens integer arithmetic to 64 bits,
  which AVX2 cannot multiply or compare as vectors; each step is cast back, and a product's
  or sum's low 32 bits do not depend on the width it is computed in);
- hot loops index with unsigned offsets, so Numba emits no negative-index wraparound (with it,
  LLVM could not prove the accesses contiguous and loaded each element with a gather);
- one group function per width (:func:`_group_kernel`), so the width is a constant in its
  loops and the codes are joined into bytes a scratch word at a time;
- the metadata's powers of two come from float bits, not libm calls (:mod:`cpu_scalar`).

A slow, general loop handles the last partial group and groups whose random stream crosses a
2**32 boundary. Parallel tasks take ``_CHUNK`` groups each.
"""

from __future__ import annotations

import types

import numba
import numpy as np
from numba import prange
from numba.extending import intrinsic

from . import layout
from .cpu_scalar import SCALAR, order_key, random24_u32
from .scalar import INV_2_24, MASK32

_inline = numba.njit(inline="always")
#: Helpers compiled once and linked into the kernels (LLVM may still inline them): Numba's own
#: inlining would type them again in every caller and multiply the compile time.
_jit = numba.njit(cache=True, nogil=True)
_stream_key = SCALAR.stream_key
_random24 = SCALAR.random24
_group_meta = SCALAR.group_meta
_meta_values = SCALAR.meta_values

_U32 = np.uint32
_U64 = np.uint64
#: Groups a parallel task packs in turn, sharing one scratch buffer.
_CHUNK = 16
#: Per input dtype: the signed integer view, the magnitude mask and the bits of +inf (see
#: _min_max).
_BITS = {
    np.dtype(np.float32): (np.int32, np.int32(0x7FFFFFFF), np.int32(0x7F800000)),
    np.dtype(np.float64): (np.int64, np.int64(0x7FFFFFFFFFFFFFFF), np.int64(0x7FF0000000000000)),
}


@_jit
def _min_max(words, start, count, magnitude, inf_key, positive):  # pragma: no cover - jitted
    """Order keys (see :func:`cpu_scalar.order_key`) of the min (of the positive values only, if
    ``positive``: +inf's key when there are none) and max of ``words[start:start + count]``
    (the floats' bits as signed integers), and whether the group holds NaN or inf (keys
    beyond +-inf's). Integer min/max vectorizes where float min/max does not."""
    kt = words.dtype.type  # 32-bit lanes for float32
    mag = kt(magnitude)
    inf = kt(inf_key)
    lo = inf
    hi = kt(-inf)
    s = _U64(start)
    if positive:
        lo_pos = inf
        for i in range(count):
            k = kt(order_key(words[s + _U64(i)], mag))
            lo = kt(min(lo, k))
            hi = kt(max(hi, k))
            lo_pos = kt(min(lo_pos, k if k > 0 else inf))
        return lo_pos, hi, hi >= inf or lo < -inf
    for i in range(count):
        k = kt(order_key(words[s + _U64(i)], mag))
        lo = kt(min(lo, k))
        hi = kt(max(hi, k))
    return lo, hi, hi >= inf or lo < -inf


@_inline
def _code(x, fl, up, base, top, zero_code):  # pragma: no cover - jitted
    """The code of element ``x`` at grid position ``fl`` (+1 when rounded ``up``), clamped to
    [base, top]; in zero-code mode (base 1) code 0 marks an exact zero (the general loop)."""
    lowest = np.int32(base)
    c = min(max(np.int32(fl) + np.int32(up) + lowest, lowest), np.int32(top))
    return np.uint8(c * np.int32(x > 0 or not zero_code))


@_jit
def _codes_stochastic(x, start, count, dst, off, lo, inv, top, zero_code, key32,
                      low32):  # pragma: no cover - jitted
    """One code a byte at ``dst[off:]`` for ``x[start:start + count]``, stochastic rounding.
    ``v >= 0`` (lo <= the group's min), so int32 truncation is the floor and no clamp below
    is needed; the random stream's index is ``low32 + i`` (no 2**32 crossing)."""
    t = x.dtype.type
    u = t(INV_2_24)
    s = _U64(start)
    o = _U64(off)
    one = np.int32(zero_code)
    for i in range(count):
        xi = x[s + _U64(i)]
        v = (xi - lo) * inv
        vi = np.int32(v)
        r = t(random24_u32(key32, _U32(low32 + _U32(i)))) * u
        c = np.int32(min(np.int32(vi + np.int32(r < v - t(vi)) + one), top))
        if zero_code:
            c = c if xi > 0 else np.int32(0)
        dst[o + _U64(i)] = np.uint8(c)


@_jit
def _codes_nearest(x, start, count, dst, off, lo, inv, top, zero_code):  # pragma: no cover
    """As :func:`_codes_stochastic`, rounding to nearest (halves up)."""
    t = x.dtype.type
    half = t(0.5)
    s = _U64(start)
    o = _U64(off)
    one = np.int32(zero_code)
    for i in range(count):
        xi = x[s + _U64(i)]
        v = (xi - lo) * inv
        vi = np.int32(v)
        c = np.int32(min(np.int32(vi + np.int32(v - t(vi) >= half) + one), top))
        if zero_code:
            c = c if xi > 0 else np.int32(0)
        dst[o + _U64(i)] = np.uint8(c)


@_jit
def _bytes_any(x, start, count, out, at, group_bytes, lo, inv, base, top, zero_code, seed,
               idx0, stochastic, per, bits):  # pragma: no cover - jitted
    """Any group: the tail group, or one whose stream index crosses a 2**32 boundary
    (``idx0``: the index of ``x[start]`` in the stream ``seed``)."""
    t = x.dtype.type
    u_step = t(INV_2_24)
    for k in range(at, min(at + group_bytes, out.size)):  # the group's bytes, padding included
        out[k] = 0
    for i in range(count):
        xi = x[start + i]
        v = (xi - lo) * inv
        fl = np.floor(v)
        if stochastic:
            idx = idx0 + i
            r = _random24(_stream_key(seed, idx >> 32), idx)
            up = t(r) * u_step < v - fl
        else:
            up = v - fl >= t(0.5)
        out[at + i // per] |= _code(xi, fl, up, base, top, zero_code) << (bits * (i % per))


@_jit
def _meta(mn, mx, levels, zero_code):  # pragma: no cover - jitted
    """:func:`scalar.group_meta`, compiled once."""
    return _group_meta(mn, mx, levels, zero_code)


def _group_kernel(bits: int):
    """The jitted function that packs one group at ``bits`` (``bits`` is a constant in it)."""
    per = 8 // bits
    levels = (1 << bits) - 1
    step = 8 - bits  # code j of a scratch word sits at bit 8j; it goes to bit bits*j

    @_jit
    def join(wide, codes, at, nbytes):  # pragma: no cover - jitted
        """Bytes of ``per`` codes from the scratch words (one code a byte each)."""
        wt = wide.dtype.type
        a = _U64(at)
        for k in range(nbytes):
            w = wide[_U64(k)]
            w = wt(w | wt(w >> wt(step)))
            if per >= 4:
                w = wt(w | wt(w >> wt(2 * step)))
            if per == 8:
                w = wt(w | wt(w >> wt(4 * step)))
            codes[a + _U64(k)] = np.uint8(w & wt(0xFF))

    @_jit
    def group(x, words, start, group_size, codes, at, meta, g, scratch, wide, magnitude,
              inf_key, seed, idx0, stochastic, zero_code):  # pragma: no cover - jitted
        """The group of ``x[start:]`` (``idx0``: its index in the random stream ``seed``):
        its metadata in ``meta[g]``, its codes from ``codes[at]``."""
        t = x.dtype.type
        gbytes = group_size * bits // 8
        count = min(group_size, x.size - start)
        full = count == group_size
        klo, khi, bad = _min_max(words, start, count, magnitude, inf_key, zero_code)
        a = order_key(klo, magnitude)
        b = order_key(khi, magnitude)
        if words.itemsize == 4:
            mn = float(np.int32(a).view(np.float32))
            mx = float(np.int32(b).view(np.float32))
        else:
            mn = float(np.int64(a).view(np.float64))
            mx = float(np.int64(b).view(np.float64))
        lo_word, scale_word, lo64, scale64 = _meta(np.nan if bad else mn, mx,
                                                   float(levels - zero_code), zero_code)
        meta[g, 0] = lo_word
        meta[g, 1] = scale_word
        if lo_word == layout.NAN16:
            for k in range(at, min(at + gbytes, codes.size)):
                codes[k] = 0
            return
        scale = t(scale64)
        inv = t(1) / scale if scale > 0 else scale
        lo = t(lo64)
        if not full or (idx0 >> 32) != ((idx0 + group_size - 1) >> 32):
            _bytes_any(x, start, count, codes, at, gbytes, lo, inv, t(zero_code), t(levels),
                       zero_code, seed, idx0, stochastic, per, bits)
            return
        dst, off = (codes, at) if per == 1 else (scratch, 0)  # 8 bits: the codes are the bytes
        if stochastic:
            _codes_stochastic(x, start, group_size, dst, off, lo, inv, np.int32(levels),
                              zero_code, _U32(_stream_key(seed, idx0 >> 32)),
                              _U32(idx0 & MASK32))
        else:
            _codes_nearest(x, start, group_size, dst, off, lo, inv, np.int32(levels), zero_code)
        if per != 1:
            join(wide, codes, at, gbytes)

    return group


_G1, _G2, _G4, _G8 = (_group_kernel(b) for b in layout.SUPPORTED_BITS)


@numba.njit(inline="always")
def _group_at(bits, x, words, start, group_size, codes, at, meta, g, scratch, w16, w32, w64,
              magnitude, inf_key, seed, idx0, stochastic, zero_code):  # pragma: no cover
    """Pack one group with the function compiled for its width."""
    if bits == 1:
        _G1(x, words, start, group_size, codes, at, meta, g, scratch, w64, magnitude, inf_key,
            seed, idx0, stochastic, zero_code)
    elif bits == 2:
        _G2(x, words, start, group_size, codes, at, meta, g, scratch, w32, magnitude, inf_key,
            seed, idx0, stochastic, zero_code)
    elif bits == 4:
        _G4(x, words, start, group_size, codes, at, meta, g, scratch, w16, magnitude, inf_key,
            seed, idx0, stochastic, zero_code)
    else:
        _G8(x, words, start, group_size, codes, at, meta, g, scratch, scratch, magnitude,
            inf_key, seed, idx0, stochastic, zero_code)


@numba.njit(inline="always")
def _pack_groups(x, words, magnitude, inf_key, codes, meta, bits, group_size, seed, base,
                 stochastic, zero_code):  # pragma: no cover - jitted
    groups = meta.shape[0]
    group_bytes = group_size * bits // 8
    for c in prange((groups + _CHUNK - 1) // _CHUNK):
        scratch = np.empty(group_size, np.uint8)  # one code a byte, reused by the chunk
        w16, w32, w64 = scratch.view(np.uint16), scratch.view(np.uint32), scratch.view(np.uint64)
        for g in range(c * _CHUNK, min((c + 1) * _CHUNK, groups)):
            start = g * group_size
            _group_at(bits, x, words, start, group_size, codes, g * group_bytes, meta, g,
                      scratch, w16, w32, w64, magnitude, inf_key, seed, base + start,
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
#: the thread pool costs more than it saves (one 2-bit tensor of 4,096 elements: 5.4 against
#: 7.7 us to pack, 1.5 against 4.8 us to unpack; docs/benchmarks.md).
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
