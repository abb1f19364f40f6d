"""Numba CPU kernels for several tensors in one call: segments of one flat array.

One int64 table, ``[5, segments + 1]`` (:func:`segment_table`), describes the segments to
these kernels and to the CUDA ones (:mod:`actune_kernels.cuda`): segment ``s`` is
``x[table[0, s]:table[0, s + 1]]``, its groups start at ``meta[table[1, s]]``, its codes at
byte ``table[2, s]``, it is packed at ``table[3, s]`` bits and ``table[4, s]`` says whether
code 0 is kept for exact zeros. Its bytes and metadata are those
:func:`actune_kernels.cpu.pack` gives the segment alone with ``base = table[0, s]`` (its
elements' indices in the random stream): each segment's last group is its own partial group,
never shared with the next segment. Empty segments own no group and no byte. One call
replaces one kernel call a tensor, whose fixed cost dominates for small tensors.
"""

from __future__ import annotations

from itertools import accumulate

import numba
import numpy as np
from numba import prange

from .cpu import SERIAL_PACK, SERIAL_UNPACK, _serial, _unpack_group
from .cpu_groups import _BITS, _CHUNK, _groups_at
from .cpu_scalar import SCALAR

__all__ = ["pack_segments", "segment_table", "unpack_segments"]

_meta_values = SCALAR.meta_values


def segment_table(numels, bits, zeros, group_size: int) -> np.ndarray:
    """The table of the segments of ``numels`` elements at ``bits``, ``zeros`` their
    zero-code flags: rows of where each segment's elements, groups and code bytes begin (the
    totals last), then its width and its flag (each row one entry longer than segments)."""
    groups = [-(-int(n) // group_size) for n in numels]
    nbytes = [g * (group_size * int(b) // 8) for g, b in zip(groups, bits, strict=True)]
    return np.array([[0, *accumulate(int(n) for n in numels)], [0, *accumulate(groups)],
                     [0, *accumulate(nbytes)], [*map(int, bits), 0], [*map(int, zeros), 0]],
                    np.int64)


@numba.njit(parallel=True, cache=True, nogil=True)
def _pack_segments(x, words, magnitude, inf_key, codes, meta, table, group_size, seed,
                   stochastic):  # pragma: no cover - jitted
    start, group, codes_at, seg_bits, seg_zero = table[0], table[1], table[2], table[3], table[4]
    groups = meta.shape[0]
    for c in prange((groups + _CHUNK - 1) // _CHUNK):
        g = c * _CHUNK
        last = min(g + _CHUNK, groups)
        s = np.searchsorted(group, g, side="right") - 1
        while g < last:  # one run of groups a segment
            while g >= group[s + 1]:  # (empty segments own no group: skipped here)
                s += 1
            end = min(last, group[s + 1])
            bits = seg_bits[s]
            local = g - group[s]
            at = codes_at[s] + local * (group_size * bits // 8)
            begin = start[s] + local * group_size
            stop = start[s + 1]  # the segment's last group ends with it
            _groups_at(bits, x[:stop], words[:stop], g, end, begin, group_size, codes, at,
                       meta, magnitude, inf_key, seed, begin, stochastic, seg_zero[s] != 0)
            g = end


@numba.njit(parallel=True, cache=True, nogil=True)
def _unpack_segments(codes, meta, table, group_size, y):  # pragma: no cover - jitted
    start, group, codes_at, seg_bits, seg_zero = table[0], table[1], table[2], table[3], table[4]
    t = y.dtype.type
    for g in prange(meta.shape[0]):
        s = np.searchsorted(group, g, side="right") - 1
        bits = seg_bits[s]
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
        zero_code = seg_zero[s] != 0
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


def _check(table: np.ndarray) -> None:
    if table.ndim != 2 or table.shape[0] != 5 or table.dtype != np.int64:
        raise ValueError(f"the segment table is int64 [5, segments + 1] (rows one entry more "
                         f"than segments; see segment_table), got {table.dtype} "
                         f"{list(table.shape)}")


def pack_segments(x: np.ndarray, codes: np.ndarray, meta: np.ndarray, table: np.ndarray,
                  group_size: int, seed: int, stochastic: bool = True) -> None:
    """Pack the segments of 1-D float32/float64 ``x`` that ``table`` describes (see the
    module's docstring) into ``codes`` (uint8) and ``meta`` (uint16 [G, 2])."""
    _check(table)
    if meta.shape[0]:
        view, magnitude, inf_key = _BITS[x.dtype]
        kernel = _pack_segments if x.size >= SERIAL_PACK else _pack_segments_serial
        kernel(x, x.view(view), magnitude, inf_key, codes, meta, table, group_size,
               np.int64(seed), bool(stochastic))


def unpack_segments(codes: np.ndarray, meta: np.ndarray, table: np.ndarray, group_size: int,
                    out: np.ndarray) -> None:
    """Fill 1-D float32/float64 ``out`` from what :func:`pack_segments` wrote."""
    _check(table)
    if meta.shape[0]:
        kernel = _unpack_segments if out.size >= SERIAL_UNPACK else _unpack_segments_serial
        kernel(codes, meta, table, group_size, out)
