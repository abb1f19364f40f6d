"""Numba CPU kernels for the column layout: groups of ``rows`` rows by one feature.

A row-major ``[R, F]`` tensor (features last, ``F`` a multiple of 8) is packed in row blocks
of ``rows`` rows; each feature of a block is one group (``meta[b * F + f]``), so a feature's
values share a range and a feature with small values keeps its own fine step, as in a
feature-major layout, without transposing anything. Codes stay in memory order (element
``i`` at bit ``i * bits``, its index ``i`` in the random stream, as in :mod:`.cpu`); rows
past ``R`` in the last block are padding (code 0). Every loop runs along the features,
contiguous in memory: the per-feature minimum and maximum are vector min/max down the rows,
and codes and values take their feature's ``lo`` and step from small arrays.

Each parallel task takes one row block by a run of its features (:func:`task_features`: the
whole block where there are enough blocks for the threads). (No serial variant, as
:mod:`.cpu` has for small tensors: the tensors packed by feature are layers' inputs, large,
and a second compilation of these kernels would double their first-use cost.)
"""

from __future__ import annotations

import functools

import numba
import numpy as np
from numba import prange

from . import layout
from .cpu import _LIKE, _pointer, _value
from .cpu_groups import _BITS, meta_of_keys
from .cpu_scalar import SCALAR, order_key, random24_u32
from .scalar import INV_2_24, MASK32

_meta_values = SCALAR.meta_values
_stream_key = SCALAR.stream_key
_random24 = SCALAR.random24
_U32 = np.uint32
_U64 = np.uint64
#: The most features a parallel task takes: a task's rows run longer the more it takes
#: (docs/benchmarks.md, "Step speed on the CPU").
MAX_TASK_FEATURES = 1024
#: Tasks wanted per thread, where the row blocks alone are fewer.
TASKS_PER_THREAD = 2
_jit = numba.njit(cache=True, nogil=True)


def _cached(fn, name: str):
    """``fn`` compiled under its own name: Numba's on-disk cache names a function's files by
    its qualified name and line, the same for each width's closure, and two processes adding
    entries to one index at once can number them alike and load another width's code."""
    fn.__name__ = fn.__qualname__ = name
    return _jit(fn)


def column_groups(rows_total: int, features: int, rows: int) -> int:
    """Groups of an ``[rows_total, features]`` tensor in blocks of ``rows`` rows."""
    return -(-rows_total // rows) * features


def task_features(total: int, width: int, rows: int, threads: int) -> int:
    """Features a parallel task takes (a multiple of 8, so its codes start on a byte at any
    width): a whole row block, in as few runs as keep ``threads`` busy with
    :data:`TASKS_PER_THREAD` tasks each, at most :data:`MAX_TASK_FEATURES`. The split sets
    only which thread writes what: the bytes are the same for any."""
    blocks = -(-total // rows)
    runs = max(-(-width // MAX_TASK_FEATURES), -(-TASKS_PER_THREAD * threads // blocks))
    return min(width, max(8, (-(-width // runs) + 7) // 8 * 8))


@functools.lru_cache(maxsize=512)
def _features_of(total: int, width: int, rows: int) -> int:
    """:func:`task_features` for Numba's threads when a shape is first seen (reading the
    count costs more than a small tensor's kernel saves; a later change of it alters only
    the split, never the bytes)."""
    return task_features(total, width, rows, numba.get_num_threads())


def column_codes_nbytes(rows_total: int, features: int, rows: int, bits: int) -> int:
    """Code bytes of the same (padding rows included)."""
    return -(-rows_total // rows) * rows * features * bits // 8


@_jit
def _ranges(x, words, r0, r1, width, f0, nf, magnitude, inf_key, zero_code, lo_t, inv_t,
            good, meta, levels):  # pragma: no cover - jitted
    """Each feature's group in rows ``[r0, r1)``: its metadata into ``meta`` (from row
    ``r0 // rows``'s groups) and its ``lo``, inverse step and finiteness into the arrays."""
    kt = words.dtype.type
    mag = kt(magnitude)
    inf = kt(inf_key)
    lo = np.full(nf, inf, kt)
    hi = np.full(nf, kt(-inf), kt)
    lo_pos = np.full(nf, inf, kt)
    for r in range(r0, r1):
        base = _U64(r * width + f0)
        if zero_code:
            for j in range(nf):
                k = kt(order_key(words[base + _U64(j)], mag))
                lo[j] = kt(min(lo[j], k))
                hi[j] = kt(max(hi[j], k))
                lo_pos[j] = kt(min(lo_pos[j], k if k > 0 else inf))
        else:
            for j in range(nf):
                k = kt(order_key(words[base + _U64(j)], mag))
                lo[j] = kt(min(lo[j], k))
                hi[j] = kt(max(hi[j], k))
    t = x.dtype.type
    for j in range(nf):
        bad = hi[j] >= inf or lo[j] < -inf
        lo_word, scale_word, lo64, scale64 = meta_of_keys(
            lo_pos[j] if zero_code else lo[j], hi[j], bad, magnitude, words.itemsize, levels,
            zero_code)
        meta[j, 0] = lo_word
        meta[j, 1] = scale_word
        ok = lo_word != layout.NAN16
        good[j] = np.int32(ok)
        lo_t[j] = t(lo64) if ok else t(0)
        inv_t[j] = (t(1) / t(scale64) if scale64 > 0 else t(0)) if ok else t(0)


@numba.njit(inline="always")
def _row_stochastic(x, base, nf, lo_t, inv_t, good, scratch, top, one, keep, key32,
                    low32):  # pragma: no cover - jitted
    """One code a byte for a row's features, stochastic rounding (no 2**32 crossing)."""
    t = x.dtype.type
    u = t(INV_2_24)
    for j in range(nf):
        xi = x[base + _U64(j)]
        xi = xi if good[j] else t(0)  # (a group with NaN or inf: code 0, no NaN arithmetic)
        v = (xi - lo_t[j]) * inv_t[j]
        vi = np.int32(v)
        up = np.int32(t(random24_u32(key32, _U32(low32 + _U32(j)))) * u < v - t(vi))
        c = np.int32(min(np.int32(vi + up + one), top))
        scratch[j] = np.uint8(c * np.int32(xi > 0 or keep) * good[j])


@numba.njit(inline="always")
def _row_nearest(x, base, nf, lo_t, inv_t, good, scratch, top, one,
                 keep):  # pragma: no cover - jitted
    """As :func:`_row_stochastic`, rounding to nearest (halves up)."""
    t = x.dtype.type
    half = t(0.5)
    for j in range(nf):
        xi = x[base + _U64(j)]
        xi = xi if good[j] else t(0)
        v = (xi - lo_t[j]) * inv_t[j]
        vi = np.int32(v)
        c = np.int32(min(np.int32(vi + np.int32(v - t(vi) >= half) + one), top))
        scratch[j] = np.uint8(c * np.int32(xi > 0 or keep) * good[j])


@_jit
def _row_any(x, base, idx0, nf, lo_t, inv_t, good, scratch, top, one, keep,
             seed):  # pragma: no cover - jitted
    """A row whose stream indices cross a 2**32 boundary: a key per element."""
    t = x.dtype.type
    u = t(INV_2_24)
    for j in range(nf):
        xi = x[base + _U64(j)]
        xi = xi if good[j] else t(0)
        v = (xi - lo_t[j]) * inv_t[j]
        vi = np.int32(v)
        idx = idx0 + j
        up = np.int32(t(_random24(_stream_key(seed, idx >> 32), idx)) * u < v - t(vi))
        c = np.int32(min(np.int32(vi + up + one), top))
        scratch[j] = np.uint8(c * np.int32(xi > 0 or keep) * good[j])


def _columns_kernel(bits: int):
    """The jitted function packing one task (a row block by some features) at ``bits``."""
    per = 8 // bits
    levels = (1 << bits) - 1
    step = 8 - bits  # code j of a scratch word sits at bit 8j; it goes to bit bits*j
    word = {1: np.uint64, 2: np.uint32, 4: np.uint16, 8: np.uint8}[bits]

    def task(x, words, total, width, rows, b, f0, f1, codes, meta, magnitude, inf_key, seed,
             base0, stochastic, zero_code):  # pragma: no cover - jitted
        nf = f1 - f0
        r0 = b * rows
        r1 = min(r0 + rows, total)
        lo_t = np.empty(nf, x.dtype)
        inv_t = np.empty(nf, x.dtype)
        good = np.empty(nf, np.int32)
        _ranges(x, words, r0, r1, width, f0, nf, magnitude, inf_key, zero_code, lo_t, inv_t,
                good, meta[b * width + f0:b * width + f1], levels)
        scratch = np.zeros(nf, np.uint8)  # one code a byte, joined into bytes per row
        wide = scratch.view(word)
        nbytes = nf * bits // 8
        top = np.int32(levels)
        one = np.int32(zero_code)
        keep = not zero_code
        for r in range(r0, r0 + rows):
            at = _U64((r * width + f0) * bits // 8)
            if r >= r1:  # padding rows
                for k in range(nbytes):
                    codes[at + _U64(k)] = 0
                continue
            base = _U64(r * width + f0)
            idx0 = base0 + r * width + f0
            if not stochastic:
                _row_nearest(x, base, nf, lo_t, inv_t, good, scratch, top, one, keep)
            elif (idx0 >> 32) != ((idx0 + nf - 1) >> 32):
                _row_any(x, base, idx0, nf, lo_t, inv_t, good, scratch, top, one, keep, seed)
            else:
                _row_stochastic(x, base, nf, lo_t, inv_t, good, scratch, top, one, keep,
                                _U32(_stream_key(seed, idx0 >> 32)), _U32(idx0 & MASK32))
            if per == 1:
                for k in range(nbytes):
                    codes[at + _U64(k)] = scratch[k]
                continue
            wt = wide.dtype.type
            for k in range(nbytes):
                w = wide[_U64(k)]
                w = wt(w | wt(w >> wt(step)))
                if per >= 4:
                    w = wt(w | wt(w >> wt(2 * step)))
                if per == 8:
                    w = wt(w | wt(w >> wt(4 * step)))
                codes[at + _U64(k)] = np.uint8(w & wt(0xFF))

    return _cached(task, f"pack_columns_{bits}")


_T1, _T2, _T4, _T8 = (_columns_kernel(b) for b in layout.SUPPORTED_BITS)


@numba.njit(inline="always")
def _task_at(bits, x, words, total, width, rows, b, f0, f1, codes, meta, magnitude, inf_key,
             seed, base0, stochastic, zero_code):  # pragma: no cover - jitted
    if bits == 1:
        _T1(x, words, total, width, rows, b, f0, f1, codes, meta, magnitude, inf_key, seed,
            base0, stochastic, zero_code)
    elif bits == 2:
        _T2(x, words, total, width, rows, b, f0, f1, codes, meta, magnitude, inf_key, seed,
            base0, stochastic, zero_code)
    elif bits == 4:
        _T4(x, words, total, width, rows, b, f0, f1, codes, meta, magnitude, inf_key, seed,
            base0, stochastic, zero_code)
    else:
        _T8(x, words, total, width, rows, b, f0, f1, codes, meta, magnitude, inf_key, seed,
            base0, stochastic, zero_code)


@numba.njit(parallel=True, cache=True, nogil=True)
def _pack_columns(x_at, total, width, like, magnitude, inf_key, codes_at, meta_at, bits, rows,
                  seed, base0, stochastic, zero_code, features):  # pragma: no cover - jitted
    n = total * width
    x = numba.carray(_pointer(x_at, like), n)
    words = numba.carray(_pointer(x_at, magnitude), n)
    blocks = (total + rows - 1) // rows
    codes = numba.carray(_pointer(codes_at, np.uint8(0)), blocks * rows * width * bits // 8)
    meta = numba.carray(_pointer(meta_at, np.uint16(0)), (blocks * width, 2))
    chunks = (width + features - 1) // features
    for task in prange(blocks * chunks):
        b = task // chunks
        f0 = (task - b * chunks) * features
        _task_at(bits, x, words, total, width, rows, b, f0, min(f0 + features, width), codes,
                 meta, magnitude, inf_key, seed, base0, stochastic, zero_code)


def _unpack_kernel(bits: int):
    """The jitted function unpacking rows of some features at ``bits`` (a constant in it)."""
    per = 8 // bits
    word = {1: np.uint64, 2: np.uint32, 4: np.uint16, 8: np.uint8}[bits]
    # a byte's codes spread one a byte (code j to bit 8j), undoing the pack's joining: each
    # step doubles the distance between codes, ``(w | w << shift) & keep``
    steps = {1: ((28, 0x0000000F0000000F), (14, 0x0003000300030003), (7, 0x0101010101010101)),
             2: ((12, 0x000F000F), (6, 0x03030303)), 4: ((4, 0x0F0F),), 8: ()}[bits]
    (s1, k1), (s2, k2), (s3, k3) = (*steps, *((0, 0),) * (3 - len(steps)))
    n_steps = len(steps)

    def rows_at(codes, y, lo, scale, r0, r1, width, f0, nf, zero_code, other,
                times):  # pragma: no cover - jitted
        """Rows ``[r0, r1)`` of features ``f0`` to ``f0 + nf``, each feature with its own
        ``lo`` and step (``times``: each value multiplied by ``other``'s at its index): a
        row's codes spread one a byte, then one vectorised pass."""
        t = y.dtype.type
        scratch = np.empty(nf, np.uint8)
        wide = scratch.view(word)
        wt = wide.dtype.type
        for r in range(r0, r1):
            at = _U64((r * width + f0) // per)
            out = _U64(r * width + f0)
            if per == 1 and not times:  # (a code a byte already: one pass)
                for i in range(nf):
                    y[out + _U64(i)] = _value(codes[at + _U64(i)], lo[i], scale[i], zero_code,
                                              t)
                continue
            if per == 1:
                for i in range(nf):
                    scratch[i] = codes[at + _U64(i)]
            else:
                for k in range(nf // per):
                    w = wt(codes[at + _U64(k)])
                    if n_steps >= 1:
                        w = wt(wt(w | wt(w << wt(s1))) & wt(k1))
                    if n_steps >= 2:
                        w = wt(wt(w | wt(w << wt(s2))) & wt(k2))
                    if n_steps >= 3:
                        w = wt(wt(w | wt(w << wt(s3))) & wt(k3))
                    wide[k] = w
            if times:
                for i in range(nf):
                    y[out + _U64(i)] = (_value(scratch[i], lo[i], scale[i], zero_code, t)
                                        * other[out + _U64(i)])
            else:
                for i in range(nf):
                    y[out + _U64(i)] = _value(scratch[i], lo[i], scale[i], zero_code, t)

    return _cached(rows_at, f"unpack_columns_{bits}")


_U1, _U2, _U4, _U8 = (_unpack_kernel(b) for b in layout.SUPPORTED_BITS)


@numba.njit(inline="always")
def _unpack_rows_at(bits, codes, y, lo, scale, r0, r1, width, f0, nf, zero_code, other,
                    times):  # pragma: no cover - jitted
    if bits == 1:
        _U1(codes, y, lo, scale, r0, r1, width, f0, nf, zero_code, other, times)
    elif bits == 2:
        _U2(codes, y, lo, scale, r0, r1, width, f0, nf, zero_code, other, times)
    elif bits == 4:
        _U4(codes, y, lo, scale, r0, r1, width, f0, nf, zero_code, other, times)
    else:
        _U8(codes, y, lo, scale, r0, r1, width, f0, nf, zero_code, other, times)


@numba.njit(parallel=True, cache=True, nogil=True)
def _unpack_columns(codes_at, meta_at, bits, rows, zero_code, out_at, total, width, like,
                    times_at, features):  # pragma: no cover - jitted
    n = total * width
    y = numba.carray(_pointer(out_at, like), n)
    blocks = (total + rows - 1) // rows
    codes = numba.carray(_pointer(codes_at, np.uint8(0)), blocks * rows * width * bits // 8)
    meta = numba.carray(_pointer(meta_at, np.uint16(0)), (blocks * width, 2))
    other = numba.carray(_pointer(times_at if times_at else out_at, like), n)  # (0: unread)
    t = y.dtype.type
    chunks = (width + features - 1) // features
    for task in prange(blocks * chunks):
        b = task // chunks
        f0 = (task - b * chunks) * features
        f1 = min(f0 + features, width)
        nf = f1 - f0
        lo = np.empty(nf, y.dtype)
        scale = np.empty(nf, y.dtype)
        for j in range(nf):
            lo64, scale64 = _meta_values(meta[b * width + f0 + j, 0], meta[b * width + f0 + j, 1])
            lo[j] = t(lo64)
            scale[j] = t(scale64)
        _unpack_rows_at(bits, codes, y, lo, scale, b * rows, min(b * rows + rows, total),
                        width, f0, nf, zero_code, other, times_at != 0)


def pack_columns_at(x_at: int, total: int, width: int, dtype: np.dtype, codes_at: int,
                    meta_at: int, bits: int, rows: int, seed: int, stochastic: bool = True,
                    zero_code: bool = False, base: int = 0, features: int = 0) -> None:
    """Pack the row-major ``[total, width]`` values of ``dtype`` at ``x_at`` (``width`` a
    multiple of 8) in groups of ``rows`` rows by one feature: the codes (memory order,
    :func:`column_codes_nbytes` bytes) at ``codes_at``, the metadata (``[blocks * width, 2]``
    uint16, block-major) at ``meta_at``; ``base``: the stream index of the first element;
    ``features``: a task's features (0: :func:`task_features`; the bytes are the same for
    any multiple of 8). The caller vouches for the buffers, as for
    :func:`actune_kernels.cpu.pack_at`."""
    if width % 8:
        raise ValueError(f"the column layout needs a multiple of 8 features, got {width}")
    if total * width:
        _, magnitude, inf_key = _BITS[dtype]
        _pack_columns(x_at, total, width, _LIKE[dtype], magnitude, inf_key, codes_at,
                      meta_at, bits, rows, seed, base, bool(stochastic), bool(zero_code),
                      features or _features_of(total, width, rows))


def unpack_columns_at(codes_at: int, meta_at: int, bits: int, rows: int, out_at: int,
                      total: int, width: int, dtype: np.dtype, zero_code: bool = False,
                      times_at: int = 0, features: int = 0) -> None:
    """The inverse of :func:`pack_columns_at`: the row-major ``[total, width]`` values at
    ``out_at``; with ``times_at`` (the address of ``total * width`` values of ``dtype`` in the
    same order, which may be ``out_at``) each value multiplied by its own there as it is
    written, in place of a pass over a dequantized copy; ``features`` as there."""
    if total * width:
        _unpack_columns(codes_at, meta_at, bits, rows, bool(zero_code), out_at, total,
                        width, _LIKE[dtype], times_at,
                        features or _features_of(total, width, rows))
