"""Max-pool argmax indices <-> offsets inside each pooling window (CPU, Numba).

``indices`` are PyTorch's: for each output element, the flat index of its maximum within the
input plane (N * C planes). The offset is the window-local position of that maximum in
row-major kernel order, small enough for one byte when the window has at most 256 elements.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import prange

from actune_kernels.cpu import _serial


@numba.njit(parallel=True, cache=True, nogil=True)
def _to_offsets(idx, out, in_w, out_h, out_w, kw, sy, sx, py, px, dy, dx,
                lanes32):  # pragma: no cover - jitted
    # the argmax lies in its window: idx = (y0 + ky) * in_w + (x0 + kx) with 0 <= kx < span,
    # so when a window row is narrower than the input, rel = idx - (y0 * in_w + x0) splits
    # into ky = rel // in_w and kx. With unit dilation and indices that fit 32 bits
    # (``lanes32``) the division is a product by 1 / in_w corrected by one step either way
    # (rel is small: exact in float64), in 32-bit lanes: the loop vectorizes (a division
    # does not, and took 5x as long).
    narrow = (kw - 1) * dx < in_w
    unit = dy == 1 and dx == 1
    width = np.int32(in_w)
    inv = 1.0 / in_w
    for p in prange(idx.shape[0]):
        row_in = idx[p]
        row_out = out[p]
        for oy in range(out_h):
            y0 = oy * sy - py
            if narrow and unit and lanes32:
                corner = np.int32(y0 * in_w - px)
                first = np.uint64(oy * out_w)
                for ox in range(out_w):
                    j = first + np.uint64(ox)
                    rel = np.int32(np.int32(row_in[j]) - corner - np.int32(ox * sx))
                    ky = np.int32(rel * inv)
                    ky = np.int32(ky - np.int32(ky * width > rel)
                                  + np.int32((ky + 1) * width <= rel))
                    row_out[j] = np.uint8(ky * kw + (rel - ky * width))
                continue
            for ox in range(out_w):
                j = oy * out_w + ox
                x0 = ox * sx - px
                i = row_in[j]
                if narrow:
                    rel = i - (y0 * in_w + x0)
                    ky = rel // in_w
                    kx = rel - ky * in_w
                else:
                    iy = i // in_w
                    ky = iy - y0
                    kx = i - iy * in_w - x0
                row_out[j] = ky * kw + kx if unit else (ky // dy) * kw + kx // dx


@numba.njit(parallel=True, cache=True, nogil=True)
def _to_indices(off, out, in_w, out_h, out_w, kw, sy, sx, py, px, dy, dx):  # pragma: no cover
    # an offset's distance from its window's top-left corner, in input elements, by table
    step = np.empty(256, dtype=np.int64)
    for o in range(256):
        ky = o // kw
        step[o] = ky * dy * in_w + (o - ky * kw) * dx
    for p in prange(off.shape[0]):
        for oy in range(out_h):
            row = (oy * sy - py) * in_w - px
            for ox in range(out_w):
                j = oy * out_w + ox
                out[p, j] = row + ox * sx + step[off[p, j]]


#: The same kernels on the calling thread alone, for outputs under this many elements (as
#: actune_kernels.cpu does for packing): waking the thread pool costs more there.
SERIAL = 16384
_to_offsets_serial = _serial(_to_offsets)
_to_indices_serial = _serial(_to_indices)


def offsets_2d(indices: np.ndarray, out: np.ndarray, in_w: int, kernel, stride, padding,
               dilation) -> None:
    """Fill ``out`` (uint8, [planes, out_h * out_w]) with window offsets of 2-d ``indices``
    (int64, [planes, out_h, out_w])."""
    planes, out_h, out_w = indices.shape
    rows = (out_h - 1) * stride[0] + (kernel[0] - 1) * dilation[0] + 1  # a plane's rows read
    kernel_fn = _to_offsets if indices.size >= SERIAL else _to_offsets_serial
    kernel_fn(indices.reshape(planes, -1), out, in_w, out_h, out_w, kernel[1], *stride,
              *padding, *dilation, rows * in_w < 2**31)


def indices_2d(offsets: np.ndarray, out: np.ndarray, in_w: int, out_h: int, out_w: int,
               kernel, stride, padding, dilation) -> None:
    """Fill ``out`` (int64, [planes, out_h * out_w]) with the flat input indices of
    ``offsets`` (uint8, [planes, out_h * out_w])."""
    kernel_fn = _to_indices if offsets.size >= SERIAL else _to_indices_serial
    kernel_fn(offsets, out, in_w, out_h, out_w, kernel[1], *stride, *padding, *dilation)
