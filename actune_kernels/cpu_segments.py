"""Numba CPU kernels for several tensors in one call: segments of one flat array.

Segment ``s`` is ``x[start[s]:start[s + 1]]``, packed at ``seg_bits[s]`` bits (``seg_zero[s]``:
code 0 kept for exact zeros), its groups from ``meta[group[s]]``, its codes from byte
``codes_at[s]``. Its bytes and metadata are those :func:`actune_kernels.cpu.pack` gives the
segment alone with ``base = start[s]`` (its elements' indices in the random stream): each
segment's last group is its own partial group, never shared with the next segment. One call
replaces one kernel call a tensor, whose fixed cost dominates for small tensors.

``segments(numels, bits, group_size)`` sizes the four offset arrays. Empty segments are
allowed (they own no group and no byte).
"""

from __future__ import annotations

import numba
import numpy as np
from numba import prange

from .cpu import _BITS, _CHUNK, SERIAL_PACK, SERIAL_UNPACK, _group_at, _serial, _unpack_group
from .cpu_scalar import SCALAR

__all__ = ["pack_segments", "segments", "unpack_segments"]

_meta_values = SCALAR.meta_values


def segments(numels, bits, group_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(start, group, codes_at)``, each with one entry more than segments: where each
    segment's elements, groups and code bytes begin, and the totals last."""
    numels = np.asarray(numels, np.int64)
    bits = np.asarray(bits, np.int64)
    groups = -(-numels // group_size)
    start = np.zeros(numels.size + 1, np.int64)
    group = np.zeros(numels.size + 1, np.int64)
    codes_at = np.zeros(numels.size + 1, np.int64)
    np.cumsum(numels, out=start[1:])
    np.cumsum(groups, out=group[1:])
    np.cumsum(groups * (group_size * bits // 8), out=codes_at[1:])
    return start, group, codes_at


@numba.njit(parallel=True, cache=True, nogil=True)
def _pack_segments(x, words, magnitude, inf_key, codes, meta, start, group, codes_at, seg_bits,
                   seg_zero, group_size, seed, stochastic):  # pragma: no cover - jitted
    groups = meta.shape[0]
    for c in prange((groups + _CHUNK - 1) // _CHUNK):
        scratch = np.empty(group_size, np.uint8)
        w16, w32, w64 = scratch.view(np.uint16), scratch.view(np.uint32), scratch.view(np.uint64)
        first = c * _CHUNK
        s = np.searchsorted(group, first, side="right") - 1
        for g in range(first, min(first + _CHUNK, groups)):
            while g >= group[s + 1]:  # (empty segments own no group: skipped here)
                s += 1
            bits = np.int64(seg_bits[s])
            local = g - group[s]
            at = codes_at[s] + local * (group_size * bits // 8)
            begin = start[s] + local * group_size
            end = start[s + 1]  # the segment's last group ends with it
            _group_at(bits, x[:end], words[:end], begin, group_size, codes, at, meta, g,
                      scratch, w16, w32, w64, magnitude, inf_key, seed, begin, stochastic,
                      seg_zero[s])


@numba.njit(parallel=True, cache=True, nogil=True)
def _unpack_segments(codes, meta, start, group, codes_at, seg_bits, seg_zero, group_size,
                     y):  # pragma: no cover - jitted
    t = y.dtype.type
    for g in prange(meta.shape[0]):
        s = np.searchsorted(group, g, side="right") - 1
        bits = np.int64(seg_bits[s])
        per = 8 // bits
        mask = (1 << bits) - 1
        group_bytes = group_size * bits // 8
        local = g - group[s]
        at = codes_at[s] + local * group_bytes
        begin = start[s] + local * group_size
        ys = y[begin:min(begin + group_size, start[s + 1])]
        src = codes[at:at + group_bytes]
        lo64, scale64 = _meta_values(meta[g, 0], meta[g, 1])
        lo = t(lo64)
        scale = t(scale64)
        zero_code = seg_zero[s]
        if ys.size < group_size:
            for i in range(ys.size):
                q = (src[i // per] >> ((i % per) * bits)) & mask
                if zero_code:
                    ys[i] = lo + t(q - 1) * scale if q else t(0)
                else:
                    ys[i] = lo + t(q) * scale
        else:
            _unpack_group(src, ys, lo, scale, zero_code, bits)


_pack_segments_serial = _serial(_pack_segments)
_unpack_segments_serial = _serial(_unpack_segments)


def _check(start, group, seg_bits, seg_zero) -> None:
    """Sizes only: the widths are checked by the caller, as :func:`cpu.pack`'s are."""
    n = start.size - 1
    if group.size != n + 1 or seg_bits.size != n or seg_zero.size != n:
        raise ValueError("start and group need one entry more than seg_bits and seg_zero")


def pack_segments(x: np.ndarray, codes: np.ndarray, meta: np.ndarray, start: np.ndarray,
                  group: np.ndarray, codes_at: np.ndarray, seg_bits: np.ndarray,
                  seg_zero: np.ndarray, group_size: int, seed: int,
                  stochastic: bool = True) -> None:
    """Pack the segments of 1-D float32/float64 ``x`` (see the module's docstring) into
    ``codes`` (uint8) and ``meta`` (uint16 [G, 2])."""
    _check(start, group, seg_bits, seg_zero)
    if meta.shape[0]:
        view, magnitude, inf_key = _BITS[x.dtype]
        kernel = _pack_segments if x.size >= SERIAL_PACK else _pack_segments_serial
        kernel(x, x.view(view), magnitude, inf_key, codes, meta, start, group, codes_at,
               seg_bits, seg_zero, group_size, np.int64(seed), bool(stochastic))


def unpack_segments(codes: np.ndarray, meta: np.ndarray, start: np.ndarray, group: np.ndarray,
                    codes_at: np.ndarray, seg_bits: np.ndarray, seg_zero: np.ndarray,
                    group_size: int, out: np.ndarray) -> None:
    """Fill 1-D float32/float64 ``out`` from what :func:`pack_segments` wrote."""
    _check(start, group, seg_bits, seg_zero)
    if meta.shape[0]:
        kernel = _unpack_segments if out.size >= SERIAL_UNPACK else _unpack_segments_serial
        kernel(codes, meta, start, group, codes_at, seg_bits, seg_zero, group_size, out)
