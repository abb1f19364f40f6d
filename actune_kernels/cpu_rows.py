"""CPU kernels for one tensor whose rows have their own widths (the bit allocator's per-sample
bits, :class:`actune.packing.tensors.PackedRows`): each row's bytes and metadata are those
:func:`.cpu.pack` gives the whole tensor at that row's width."""

from __future__ import annotations

import numba
import numpy as np
from numba import prange

from .cpu import _meta_values, _unpack_group
from .cpu_groups import _BITS, _CHUNK, _groups_at

__all__ = ["pack_rows", "unpack_rows"]


@numba.njit(parallel=True, cache=True, nogil=True)
def _pack_rows(x, words, magnitude, inf_key, codes, meta, row_bits, row_offset, group_size,
               seed, base, stochastic, zero_code):  # pragma: no cover - jitted
    per_row = x.size // row_bits.size // group_size  # groups per row
    groups = meta.shape[0]
    for c in prange((groups + _CHUNK - 1) // _CHUNK):
        g = c * _CHUNK
        last = min(g + _CHUNK, groups)
        while g < last:  # one run of groups a row
            row = g // per_row
            end = min(last, (row + 1) * per_row)
            bits = np.int64(row_bits[row])
            at = row_offset[row] + (g - row * per_row) * (group_size * bits // 8)
            start = g * group_size
            _groups_at(bits, x, words, g, end, start, group_size, codes, at, meta, magnitude,
                       inf_key, seed, base + start, stochastic, zero_code)
            g = end


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
    and metadata are those :func:`.cpu.pack` gives the whole of ``x`` at that row's width."""
    if x.size:
        view, magnitude, inf_key = _BITS[x.dtype]
        _pack_rows(x, x.view(view), magnitude, inf_key, codes, meta, row_bits, row_offset,
                   group_size, np.int64(seed), np.int64(base), bool(stochastic),
                   bool(zero_code))


def unpack_rows(codes: np.ndarray, meta: np.ndarray, row_bits: np.ndarray,
                row_offset: np.ndarray, group_size: int, out: np.ndarray,
                zero_code: bool = False) -> None:
    """Fill 1-D ``out`` from what :func:`pack_rows` wrote."""
    if out.size:
        _unpack_rows(codes, meta, row_bits, row_offset, group_size, bool(zero_code), out)
