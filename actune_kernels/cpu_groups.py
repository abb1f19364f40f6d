"""The CPU pack kernels' inner work: packing runs of groups, one pass over the input.

Each group is read into cache once for its min and max, then quantized while it is still there:
one code a byte into a scratch buffer in a unit-stride loop, then joined into whole bytes a
word at a time. The loops are written so that LLVM vectorizes them with AVX2 as with AVX-512:

- every value stays in 32-bit lanes for float32 (Numba widens integer arithmetic to 64 bits,
  which AVX2 cannot multiply or compare as vectors; each step is cast back, and a product's
  or sum's low 32 bits do not depend on the width it is computed in);
- hot loops index with unsigned offsets, so Numba emits no negative-index wraparound (with it,
  LLVM could not prove the accesses contiguous and loaded each element with a gather);
- one function per width packs a run of consecutive groups (:func:`_group_kernel`), so the
  width is a constant in its loops and the codes are joined into bytes a scratch word at a
  time; the min/max and code loops are inlined in it and it is called once a run, not once a
  group (a call with a group's dozens of arguments cost about as much as the group's codes:
  the 2-bit pack took 0.69 ns an element on one thread with a call a group, 0.46 with a call
  a run; docs/benchmarks.md);
- the metadata's powers of two come from float bits, not libm calls (:mod:`cpu_scalar`).

A slow, general loop handles the last partial group and groups whose random stream crosses a
2**32 boundary. The kernels (:mod:`.cpu`, :mod:`.cpu_rows`, :mod:`.cpu_segments`) give each
parallel task a run of ``_CHUNK`` groups (split where the width changes).
"""

from __future__ import annotations

import numba
import numpy as np

from . import layout
from .cpu_scalar import SCALAR, order_key, random24_u32
from .scalar import INV_2_24, MASK32

#: Loops inlined where they are used (Numba types them again in each caller: used in the four
#: run functions only).
_inline = numba.njit(inline="always")
#: Helpers compiled once and linked into the kernels (LLVM may still inline them): the
#: metadata's scalar code inlined into the run functions as well compiled 4x slower and ran
#: no faster.
_jit = numba.njit(cache=True, nogil=True)
_stream_key = SCALAR.stream_key
_random24 = SCALAR.random24
_group_meta = SCALAR.group_meta

_U32 = np.uint32
_U64 = np.uint64
#: Groups a parallel task packs in one run, sharing one scratch buffer.
_CHUNK = 16
#: Per input dtype: the signed integer view, the magnitude mask and the bits of +inf (see
#: _min_max).
_BITS = {
    np.dtype(np.float32): (np.int32, np.int32(0x7FFFFFFF), np.int32(0x7F800000)),
    np.dtype(np.float64): (np.int64, np.int64(0x7FFFFFFFFFFFFFFF), np.int64(0x7FF0000000000000)),
}


@_inline
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


@_inline
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
    keep = not zero_code  # (code 0 only for exact zeros, in zero-code mode)
    for i in range(count):
        xi = x[s + _U64(i)]
        v = (xi - lo) * inv
        vi = np.int32(v)
        r = t(random24_u32(key32, _U32(low32 + _U32(i)))) * u
        c = np.int32(min(np.int32(vi + np.int32(r < v - t(vi)) + one), top))
        dst[o + _U64(i)] = np.uint8(c * np.int32(xi > 0 or keep))


@_inline
def _codes_nearest(x, start, count, dst, off, lo, inv, top, zero_code):  # pragma: no cover
    """As :func:`_codes_stochastic`, rounding to nearest (halves up)."""
    t = x.dtype.type
    half = t(0.5)
    s = _U64(start)
    o = _U64(off)
    one = np.int32(zero_code)
    keep = not zero_code  # (code 0 only for exact zeros, in zero-code mode)
    for i in range(count):
        xi = x[s + _U64(i)]
        v = (xi - lo) * inv
        vi = np.int32(v)
        c = np.int32(min(np.int32(vi + np.int32(v - t(vi) >= half) + one), top))
        dst[o + _U64(i)] = np.uint8(c * np.int32(xi > 0 or keep))


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


@_inline
def meta_of_keys(klo, khi, bad, magnitude, itemsize, levels, zero_code):  # pragma: no cover
    """A group's metadata (:func:`_meta`) from the order keys of its min and max (float32's
    when ``itemsize`` is 4, else float64's) and whether it holds NaN or inf."""
    a = order_key(klo, magnitude)
    b = order_key(khi, magnitude)
    if itemsize == 4:
        mn = float(np.int32(a).view(np.float32))
        mx = float(np.int32(b).view(np.float32))
    else:
        mn = float(np.int64(a).view(np.float64))
        mx = float(np.int64(b).view(np.float64))
    return _meta(np.nan if bad else mn, mx, float(levels - zero_code), zero_code)


def _group_kernel(bits: int):
    """The jitted function that packs a run of groups at ``bits`` (a constant in it)."""
    per = 8 // bits
    levels = (1 << bits) - 1
    step = 8 - bits  # code j of a scratch word sits at bit 8j; it goes to bit bits*j
    word = {1: np.uint64, 2: np.uint32, 4: np.uint16, 8: np.uint8}[bits]

    @_inline
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

    @_inline
    def group(x, words, start, group_size, codes, at, meta, g, scratch, wide, magnitude,
              inf_key, seed, idx0, stochastic, zero_code):  # pragma: no cover - jitted
        """The group of ``x[start:]`` (``idx0``: its index in the random stream ``seed``):
        its metadata in ``meta[g]``, its codes from ``codes[at]``."""
        t = x.dtype.type
        gbytes = group_size * bits // 8
        count = min(group_size, x.size - start)
        full = count == group_size
        klo, khi, bad = _min_max(words, start, count, magnitude, inf_key, zero_code)
        lo_word, scale_word, lo64, scale64 = meta_of_keys(klo, khi, bad, magnitude,
                                                          words.itemsize, levels, zero_code)
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

    def run(x, words, first, last, start, group_size, codes, at, meta, magnitude, inf_key,
            seed, idx0, stochastic, zero_code):  # pragma: no cover - jitted
        """Groups ``first`` to ``last - 1``, consecutive in ``x`` from element ``start`` (its
        index in the random stream: ``idx0``) and in ``codes`` from byte ``at``. One call a
        run, its helpers inlined: a call a group cost about as much as packing it."""
        scratch = np.empty(group_size, np.uint8)  # one code a byte, reused by each group
        wide = scratch.view(word)
        gbytes = group_size * bits // 8
        for k in range(last - first):
            offset = k * group_size
            group(x, words, start + offset, group_size, codes, at + k * gbytes, meta,
                  first + k, scratch, wide, magnitude, inf_key, seed, idx0 + offset,
                  stochastic, zero_code)

    # (its own name per width: Numba's cache names files by qualified name and line, and two
    # processes adding one index's entries at once could number them alike)
    run.__name__ = run.__qualname__ = f"pack_groups_{bits}"
    return _jit(run)


_G1, _G2, _G4, _G8 = (_group_kernel(b) for b in layout.SUPPORTED_BITS)


@numba.njit(inline="always")
def _groups_at(bits, x, words, first, last, start, group_size, codes, at, meta, magnitude,
               inf_key, seed, idx0, stochastic, zero_code):  # pragma: no cover - jitted
    """Pack a run of groups with the function compiled for their width (see ``run`` in
    :func:`_group_kernel`)."""
    if bits == 1:
        _G1(x, words, first, last, start, group_size, codes, at, meta, magnitude, inf_key,
            seed, idx0, stochastic, zero_code)
    elif bits == 2:
        _G2(x, words, first, last, start, group_size, codes, at, meta, magnitude, inf_key,
            seed, idx0, stochastic, zero_code)
    elif bits == 4:
        _G4(x, words, first, last, start, group_size, codes, at, meta, magnitude, inf_key,
            seed, idx0, stochastic, zero_code)
    else:
        _G8(x, words, first, last, start, group_size, codes, at, meta, magnitude, inf_key,
            seed, idx0, stochastic, zero_code)
