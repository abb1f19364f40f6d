"""Max-pool argmax indices <-> offsets inside each pooling window (CPU, Numba).

``indices`` are PyTorch's: for each output element, the flat index of its maximum within the
input plane (N * C planes). The offset is the window-local position of that maximum in
row-major kernel order, small enough for one byte when the window has at most 256 elements.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import prange


@numba.njit(parallel=True, cache=True, nogil=True)
def _to_offsets(idx, out, in_w, out_h, out_w, kw, sy, sx, py, px, dy, dx):  # pragma: no cover
    plane = out_h * out_w
    for p in prange(idx.shape[0]):
        for j in range(plane):
            oy = j // out_w
            ox = j - oy * out_w
            i = idx[p, j]
            iy = i // in_w
            ix = i - iy * in_w
            out[p, j] = ((iy - (oy * sy - py)) // dy) * kw + (ix - (ox * sx - px)) // dx


@numba.njit(parallel=True, cache=True, nogil=True)
def _to_indices(off, out, in_w, out_h, out_w, kw, sy, sx, py, px, dy, dx):  # pragma: no cover
    plane = out_h * out_w
    for p in prange(off.shape[0]):
        for j in range(plane):
            oy = j // out_w
            ox = j - oy * out_w
            o = np.int64(off[p, j])
            ky = o // kw
            kx = o - ky * kw
            out[p, j] = (oy * sy - py + ky * dy) * in_w + (ox * sx - px + kx * dx)


def offsets_2d(indices: np.ndarray, out: np.ndarray, in_w: int, kernel, stride, padding,
               dilation) -> None:
    """Fill ``out`` (uint8, [planes, out_h * out_w]) with window offsets of 2-d ``indices``
    (int64, [planes, out_h, out_w])."""
    planes, out_h, out_w = indices.shape
    _to_offsets(indices.reshape(planes, -1), out, in_w, out_h, out_w, kernel[1], *stride,
                *padding, *dilation)


def indices_2d(offsets: np.ndarray, out: np.ndarray, in_w: int, out_h: int, out_w: int,
               kernel, stride, padding, dilation) -> None:
    """Fill ``out`` (int64, [planes, out_h * out_w]) with the flat input indices of
    ``offsets`` (uint8, [planes, out_h * out_w])."""
    _to_indices(offsets, out, in_w, out_h, out_w, kernel[1], *stride, *padding, *dilation)
