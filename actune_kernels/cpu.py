"""Numba CPU kernels: parallel over groups, one pass over the input.

Each group is read into cache once for its min and max, then quantized while it is still there:
one code a byte into a scratch buffer in a unit-stride loop, in 32-bit integer arithmetic
(so it vectorizes with AVX2 as with AVX-512), then gathered into whole bytes by small
functions called with constant ``bits`` (specialised per width). A slow, general loop handles
the last partial group and groups whose random stream crosses a 2**32 boundary. Parallel tasks
take ``_CHUNK`` groups each.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import prange, types
from numba.extending import intrinsic

from . import layout
from .scalar import INV_2_24, MASK32, MUL1, MUL2, build

_s = build(numba.njit(inline="always"))
_stream_key = _s.stream_key
_random24 = _s.random24
_group_meta = _s.group_meta
_meta_values = _s.meta_values

_jit = numba.njit(cache=True, nogil=True)
_U32 = np.uint32
_S8 = _U32(8)
#: Groups a parallel task packs in turn, sharing one scratch buffer.
_CHUNK = 16
#: Per input dtype: the signed integer view, the sign shift, the magnitude mask and the
#: bits of +inf (see _min_max).
_BITS = {
    np.dtype(np.float32): (np.int32, np.int32(31), np.int32(0x7FFFFFFF), np.int32(0x7F800000)),
    np.dtype(np.float64): (np.int64, np.int64(63), np.int64(0x7FFFFFFFFFFFFFFF),
                           np.int64(0x7FF0000000000000)),
}


@intrinsic
def _mix32_i32(typingctx, x):
    """:func:`scalar._mix32` of a uint32, emitted as 32-bit LLVM operations. Numba widens
    integer arithmetic to 64 bits, which AVX2 cannot multiply as vectors; a product's low 32
    bits do not depend on the width it is computed in, so the bits are the same."""
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


@numba.njit(inline="always")
def _random24_u32(key, index):  # pragma: no cover - jitted
    """:func:`scalar.random24` for uint32 ``key`` and ``index``, as int32 (exactly converted
    to float: 24 bits)."""
    return np.int32(_mix32_i32(_U32(index ^ key)) >> _S8)


@numba.njit(inline="always")
def _order_key(w, shift, magnitude):  # pragma: no cover - jitted
    """Signed integer with the order of the float whose bits are ``w`` (an involution)."""
    return w ^ ((w >> shift) & magnitude)


@_jit
def _min_max(words, start, stop, shift, magnitude, inf_key, positive):  # pragma: no cover
    """float64 min (of the positive values only, if ``positive``: +inf when there are none)
    and max of the non-empty group ``words[start:stop]``, and whether it holds NaN or inf.

    Works on the float bits (``words``: the input viewed as signed integers) mapped to
    order-preserving keys: integer min/max vectorizes where float min/max does not, and NaN
    and inf are the keys beyond +-inf's. (Groups are addressed by offsets, not slices: a slice
    costs two atomic reference-count updates, on one counter shared by every thread.)
    """
    lo = inf_key
    lo_pos = inf_key
    hi = -inf_key
    for i in range(start, stop):
        k = _order_key(words[i], shift, magnitude)
        lo = min(lo, k)
        lo_pos = min(lo_pos, k if k > 0 else inf_key)
        hi = max(hi, k)
    bad = hi >= inf_key or lo < -inf_key
    lo = _order_key(lo_pos if positive else lo, shift, magnitude)
    hi = _order_key(hi, shift, magnitude)
    if words.itemsize == 4:
        return float(np.int32(lo).view(np.float32)), float(np.int32(hi).view(np.float32)), bad
    return float(np.int64(lo).view(np.float64)), float(np.int64(hi).view(np.float64)), bad


@numba.njit(inline="always")
def _code(x, fl, up, base, top, zero_code):  # pragma: no cover - jitted
    """The code of element ``x`` at grid position ``fl`` (+1 when rounded ``up``), clamped to
    [base, top]; in zero-code mode (base 1) code 0 marks an exact zero. Branch-free, so the
    loops around it vectorize."""
    lowest = np.int32(base)
    c = min(max(np.int32(fl) + np.int32(up) + lowest, lowest), np.int32(top))
    return np.uint8(c * np.int32(x > 0 or not zero_code))


@numba.njit(inline="always")
def _gather_bytes(scratch, out, at, nbytes, per, bits):  # pragma: no cover - jitted
    """Pack the codes in ``scratch`` (one a byte) into ``out[at:at + nbytes]``, ``per`` codes
    a byte."""
    for k in range(nbytes):
        byte = np.uint8(0)
        for j in range(per):
            byte |= scratch[k * per + j] << (bits * j)
        out[at + k] = byte


@_jit
def _bytes_stochastic(x, start, out, at, nbytes, scratch, lo, inv, base, top, zero_code, key,
                      low0, per, bits):  # pragma: no cover - jitted
    """The whole bytes of the group at ``x[start]``, stochastic rounding; ``per`` = 8 //
    ``bits`` codes a byte. The codes are computed one a byte in a unit-stride loop in 32-bit
    integer arithmetic (it vectorizes with AVX2 as with AVX-512), then gathered."""
    t = x.dtype.type
    u_step = t(INV_2_24)
    key32 = _U32(key)
    low32 = _U32(low0)
    dst, off = (out, at) if per == 1 else (scratch, 0)  # 8 bits: the codes are the bytes
    for i in range(nbytes * per):
        xi = x[start + i]
        v = (xi - lo) * inv
        fl = t(np.int32(v))  # floor: v >= 0 (lo <= the group's min); no libm call
        r = t(_random24_u32(key32, _U32(low32 + _U32(i)))) * u_step
        dst[off + i] = _code(xi, fl, r < v - fl, base, top, zero_code)
    if per != 1:
        _gather_bytes(scratch, out, at, nbytes, per, bits)


@_jit
def _bytes_nearest(x, start, out, at, nbytes, scratch, lo, inv, base, top, zero_code, per,
                   bits):  # pragma: no cover - jitted
    """The whole bytes of a group, round to nearest (halves up)."""
    t = x.dtype.type
    half = t(0.5)
    dst, off = (out, at) if per == 1 else (scratch, 0)  # 8 bits: the codes are the bytes
    for i in range(nbytes * per):
        xi = x[start + i]
        v = (xi - lo) * inv
        fl = t(np.int32(v))  # floor: v >= 0
        dst[off + i] = _code(xi, fl, v - fl >= half, base, top, zero_code)
    if per != 1:
        _gather_bytes(scratch, out, at, nbytes, per, bits)


@_jit
def _bytes_any(x, start, stop, out, at, group_bytes, lo, inv, base, top, zero_code, seed, idx0,
               stochastic, per, bits):  # pragma: no cover - jitted
    """Any group: the tail group, or one whose stream index crosses a 2**32 boundary
    (``idx0``: the index of ``x[start]`` in the stream ``seed``)."""
    t = x.dtype.type
    u_step = t(INV_2_24)
    for k in range(at, min(at + group_bytes, out.size)):  # the group's bytes, padding included
        out[k] = 0
    for i in range(stop - start):
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
def _pack_group(x, start, stop, out, at, scratch, lo, inv, base, top, zero_code, seed, idx0,
                stochastic, group_size, bits):  # pragma: no cover - jitted
    key = _stream_key(seed, idx0 >> 32)
    q = (scratch, lo, inv, base, top, zero_code)
    nbytes = group_size * bits // 8
    if stop - start < group_size or (idx0 >> 32) != ((idx0 + group_size - 1) >> 32):
        _bytes_any(x, start, stop, out, at, nbytes, lo, inv, base, top, zero_code, seed, idx0,
                   stochastic, 8 // bits, bits)
    elif stochastic:
        low0 = idx0 & MASK32
        if bits == 1:
            _bytes_stochastic(x, start, out, at, nbytes, *q, key, low0, 8, 1)
        elif bits == 2:
            _bytes_stochastic(x, start, out, at, nbytes, *q, key, low0, 4, 2)
        elif bits == 4:
            _bytes_stochastic(x, start, out, at, nbytes, *q, key, low0, 2, 4)
        else:
            _bytes_stochastic(x, start, out, at, nbytes, *q, key, low0, 1, 8)
    elif bits == 1:
        _bytes_nearest(x, start, out, at, nbytes, *q, 8, 1)
    elif bits == 2:
        _bytes_nearest(x, start, out, at, nbytes, *q, 4, 2)
    elif bits == 4:
        _bytes_nearest(x, start, out, at, nbytes, *q, 2, 4)
    else:
        _bytes_nearest(x, start, out, at, nbytes, *q, 1, 8)


@numba.njit(inline="always")
def _quantize_group(x, words, start, stop, out, at, scratch, meta, g, shift, magnitude,
                    inf_key, bits, group_size, seed, idx0, stochastic,
                    zero_code):  # pragma: no cover - jitted
    """Group ``g`` (``x[start:stop]``, its codes at ``out[at]``): its metadata from its min
    and max, then its codes (zero for NaN/inf)."""
    t = x.dtype.type
    levels = (1 << bits) - 1
    mn, mx, bad = _min_max(words, start, stop, shift, magnitude, inf_key, zero_code)
    lo_word, scale_word, lo64, scale64 = _group_meta(
        np.nan if bad else mn, mx, float(levels - zero_code), zero_code)
    meta[g, 0] = lo_word
    meta[g, 1] = scale_word
    if lo_word == layout.NAN16:
        for k in range(at, min(at + group_size * bits // 8, out.size)):
            out[k] = 0
        return
    scale = t(scale64)
    inv = t(1) / scale if scale > 0 else scale
    base_code = t(1) if zero_code else t(0)  # zero-code mode: code 0 is an exact zero
    _pack_group(x, start, stop, out, at, scratch, t(lo64), inv, base_code, t(levels),
                zero_code, seed, idx0, stochastic, group_size, bits)


@numba.njit(parallel=True, cache=True, nogil=True)
def _pack(x, words, shift, magnitude, inf_key, codes, meta, bits, group_size, seed, base,
          stochastic, zero_code):  # pragma: no cover - jitted
    n = x.size
    groups = meta.shape[0]
    group_bytes = group_size * bits // 8
    for c in prange((groups + _CHUNK - 1) // _CHUNK):
        scratch = np.empty(group_size, np.uint8)  # one code a byte, reused by the chunk
        for g in range(c * _CHUNK, min((c + 1) * _CHUNK, groups)):
            start = g * group_size
            _quantize_group(x, words, start, min(start + group_size, n), codes,
                            g * group_bytes, scratch, meta, g, shift, magnitude, inf_key,
                            bits, group_size, seed, base + start, stochastic, zero_code)


@numba.njit(inline="always")
def _value(q, lo, scale, zero_code, t):  # pragma: no cover - jitted
    """lo + code * scale; in zero-code mode code 0 is 0 and code c > 0 is lo + (c - 1) scale."""
    if zero_code:
        return lo + t(q - 1) * scale if q else t(0)
    return lo + t(q) * scale


@_jit
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


@numba.njit(parallel=True, cache=True, nogil=True)
def _unpack(codes, meta, bits, group_size, zero_code, y):  # pragma: no cover - jitted
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


def pack(x: np.ndarray, codes: np.ndarray, meta: np.ndarray, bits: int, group_size: int,
         seed: int, base: int = 0, stochastic: bool = True, zero_code: bool = False) -> None:
    """Fill ``codes`` (uint8) and ``meta`` (uint16 [G, 2]) from 1-D float32/float64 ``x``.

    ``base`` is the index of ``x[0]`` in the random stream ``seed``; ``zero_code`` reserves
    code 0 for exact zeros (for tensors >= 0, such as ReLU outputs; bits >= 2).
    """
    if x.size:
        view, shift, magnitude, inf_key = _BITS[x.dtype]
        _pack(x, x.view(view), shift, magnitude, inf_key, codes, meta, bits, group_size,
              np.int64(seed), np.int64(base), bool(stochastic), bool(zero_code))


def unpack(codes: np.ndarray, meta: np.ndarray, bits: int, group_size: int,
           out: np.ndarray, zero_code: bool = False) -> None:
    """Fill 1-D float32/float64 ``out`` from ``codes`` and ``meta``."""
    if out.size:
        _unpack(codes, meta, bits, group_size, bool(zero_code), out)


@numba.njit(parallel=True, cache=True, nogil=True)
def _pack_rows(x, words, shift, magnitude, inf_key, codes, meta, row_bits, row_offset,
               group_size, seed, base, stochastic, zero_code):  # pragma: no cover - jitted
    per_row = x.size // row_bits.size // group_size  # groups per row
    groups = meta.shape[0]
    for c in prange((groups + _CHUNK - 1) // _CHUNK):
        scratch = np.empty(group_size, np.uint8)
        for g in range(c * _CHUNK, min((c + 1) * _CHUNK, groups)):
            row = g // per_row
            bits = np.int64(row_bits[row])
            group_bytes = group_size * bits // 8
            at = row_offset[row] + (g - row * per_row) * group_bytes
            start = g * group_size
            _quantize_group(x, words, start, start + group_size, codes, at, scratch, meta, g,
                            shift, magnitude, inf_key, bits, group_size, seed, base + start,
                            stochastic, zero_code)


@numba.njit(parallel=True, cache=True, nogil=True)
def _unpack_rows(codes, meta, row_bits, row_offset, group_size, zero_code,
                 y):  # pragma: no cover - jitted
    t = y.dtype.type
    per_row = y.size // row_bits.size // group_size
    for g in prange(meta.shape[0]):
        row = g // per_row
        bits = np.int64(row_bits[row])
        group_bytes = group_size * bits // 8
        at = row_offset[row] + (g - row * per_row) * group_bytes
        lo64, scale64 = _meta_values(meta[g, 0], meta[g, 1])
        lo = t(lo64)
        scale = t(scale64)
        _unpack_group(codes[at:at + group_bytes], y[g * group_size:(g + 1) * group_size], lo,
                      scale, zero_code, bits)


def pack_rows(x: np.ndarray, codes: np.ndarray, meta: np.ndarray, row_bits: np.ndarray,
              row_offset: np.ndarray, group_size: int, seed: int, base: int = 0,
              stochastic: bool = True, zero_code: bool = False) -> None:
    """Pack 1-D ``x`` made of ``row_bits.size`` rows of whole groups, row ``r`` at
    ``row_bits[r]`` bits, its codes at byte ``row_offset[r]`` of ``codes``. Each row's bytes
    and metadata are those :func:`pack` gives the whole of ``x`` at that row's width."""
    if x.size:
        view, shift, magnitude, inf_key = _BITS[x.dtype]
        _pack_rows(x, x.view(view), shift, magnitude, inf_key, codes, meta, row_bits,
                   row_offset, group_size, np.int64(seed), np.int64(base), bool(stochastic),
                   bool(zero_code))


def unpack_rows(codes: np.ndarray, meta: np.ndarray, row_bits: np.ndarray,
                row_offset: np.ndarray, group_size: int, out: np.ndarray,
                zero_code: bool = False) -> None:
    """Fill 1-D ``out`` from what :func:`pack_rows` wrote."""
    if out.size:
        _unpack_rows(codes, meta, row_bits, row_offset, group_size, bool(zero_code), out)
