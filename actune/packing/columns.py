"""Packing by feature: each group holds one feature's values of a features-last tensor.

On the CPU, for tensors whose features are a multiple of 8, the column layout
(:mod:`actune_kernels.cpu_columns`): blocks of ``group_size`` rows, each feature of a block one
group, codes in memory order; no copy is made on either side and the dequantized tensor is
row-major. Elsewhere (CUDA, traced code, other widths) the tensor is packed from a copy laid
out features first (feature-major order, :func:`feature_order`) and dequantized in that
layout. The entry point is :func:`actune.packing.tensors.quantize_checked` with ``by_feature=True``.
In the column layout :func:`dequantize_times` multiplies as it unpacks (a backward's product
of a packed operand and a gradient, in one pass).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch

from actune.packing.formats import PackedColumns, PackedTensor
from actune.packing.kernels import (
    KERNEL_DTYPES,
    NUMPY_DTYPES,
    compiling,
    draw_seed,
    empty_cpu,
    shapes_only,
)

__all__ = ["dequantize_columns", "dequantize_times", "feature_major", "feature_order",
           "folds_products", "in_columns", "quantize_columns", "unpack_columns_into"]


def feature_order(x: torch.Tensor) -> tuple[int, int, int] | None:
    """``(samples, tokens, features)`` of a contiguous features-last tensor of two dims or
    more, read in feature-major order: within each sample (2-D: the whole tensor) its last dim
    before the others. A group then runs along the tokens, one feature each: a feature's
    values share its range, as a convolution's NCHW input does by its layout. None where there
    is no such order (fewer than two features or tokens, not contiguous)."""
    return _order_of(x.shape) if x.dim() >= 2 and x.is_contiguous() else None


def _order_of(shape: torch.Size) -> tuple[int, int, int] | None:
    features = shape[-1]
    samples = shape[0] if len(shape) > 2 else 1
    tokens = math.prod(shape) // max(samples * features, 1)
    if features < 2 or tokens < 2:
        return None
    return samples, tokens, features


@functools.cache
def column_kernels():
    from actune_kernels import cpu_columns

    return cpu_columns


def feature_major(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values, same shape, with its last dim (the features) laid out before the
    others within each sample (2-D: before the rows), so that groups packed in memory order
    run along the tokens, one feature each: a feature's values share a group's range, as a
    convolution's NCHW input does by its layout, and a feature with small values (a layer
    norm's small gain, next to outlier features) keeps its own fine step. ``t`` itself if it
    is not a contiguous tensor of at least two dims and features."""
    if t.dim() < 2 or t.shape[-1] < 2 or t.numel() <= t.shape[-1] or not t.is_contiguous():
        return t
    first = 0 if t.dim() == 2 else 1  # (a sample stays whole: the allocator's unit)
    return t.movedim(-1, first).contiguous().movedim(first, -1)


def in_columns(x: torch.Tensor) -> bool:
    """Is ``x`` packed in the column layout: a real CPU tensor, outside traced code, whose
    features (a multiple of 8) the kernels take a byte of codes at a time?"""
    return (x.is_cpu and x.shape[-1] % 8 == 0 and not compiling()
            and (type(x) is torch.Tensor or shapes_only(x)))


def quantize_columns(x: torch.Tensor, bits: int, group_size: int, seed: int,
                     stochastic: bool, zero_code: bool) -> PackedColumns:
    """Pack ``x`` (which has a :func:`feature_order` and is :func:`in_columns`) in the column
    layout: groups of ``group_size`` rows by one feature, no copy
    (``actune_kernels.cpu_columns``); ``seed`` < 0 draws one."""
    width = x.shape[-1]
    total = x.numel() // width
    rows = min(group_size, total)
    kernels = column_kernels()
    codes = x.new_empty((kernels.column_codes_nbytes(total, width, rows, bits),),
                        dtype=torch.uint8)
    meta = x.new_empty((kernels.column_groups(total, width, rows), 2), dtype=torch.int16)
    if type(x) is torch.Tensor:
        src = x.detach() if x.dtype in KERNEL_DTYPES else x.detach().float()
        kernels.pack_columns_at(src.data_ptr(), total, width, NUMPY_DTYPES[src.dtype],
                                codes.data_ptr(), meta.data_ptr(), bits, rows,
                                draw_seed() if seed < 0 else seed, stochastic, zero_code)
    return PackedColumns(codes, meta, bits, rows, x.shape, x.dtype, tuple(x.stride()),
                         zero_code)


def dequantize_columns(p: PackedColumns) -> torch.Tensor:
    """:func:`actune.packing.tensors.dequantize` of a value in the column layout: row-major."""
    codes = p.codes
    if shapes_only(codes):
        return codes.new_empty(p.shape, dtype=p.dtype)
    if not codes.is_cpu:  # (moved off the CPU after packing)
        host = dataclasses.replace(p, codes=codes.cpu(), meta=p.meta.cpu())
        return dequantize_columns(host).to(codes.device)
    work = p.dtype if p.dtype in KERNEL_DTYPES else torch.float32
    out = _unpack_into(p, empty_cpu(p.numel(), work))
    return out.view(p.shape) if work == p.dtype else out.view(p.shape).to(p.dtype)


def _unpack_into(p: PackedTensor, out: torch.Tensor,
                 times: torch.Tensor | None = None) -> torch.Tensor:
    """The column kernel unpacking CPU ``p`` into contiguous ``out`` (its dtype, one the
    kernels write), each value times ``times``' (same shape and dtype) if given."""
    return unpack_columns_into(p.codes, p.meta, p.bits, p.group_size, out, p.shape[-1],
                               p.zero_code, times)


def unpack_columns_into(codes: torch.Tensor, meta: torch.Tensor, bits: int, rows: int,
                        out: torch.Tensor, width: int, zero_code: bool = False,
                        times: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`_unpack_into` of bare codes and metadata (CPU) with ``width`` features: for
    callers that hold no :class:`PackedTensor` (a compiled graph's op). Returns ``out``."""
    column_kernels().unpack_columns_at(
        codes.contiguous().data_ptr(), meta.contiguous().data_ptr(), bits, rows,
        out.data_ptr(), out.numel() // width, width, NUMPY_DTYPES[out.dtype], zero_code,
        0 if times is None else times.data_ptr())
    return out


def folds_products(p: object) -> bool:
    """Can :func:`dequantize_times` take a product as it unpacks ``p`` (a value packed in the
    column layout on the CPU, in a dtype the kernels write)?"""
    return (type(p) is PackedColumns and type(p.codes) is torch.Tensor
            and p.codes.is_cpu and p.dtype in KERNEL_DTYPES and not compiling())


def dequantize_times(p: PackedTensor, other: torch.Tensor,
                     out: torch.Tensor | None = None) -> torch.Tensor | None:
    """``dequantize(p) * other`` with the product taken as the kernel unpacks ``p`` (one pass,
    no dequantized copy), written into ``out`` if given (it may be ``other``); None where
    ``p`` is not in the column layout on the CPU or the operands' shape, dtype or layout
    differ from the value's (the caller multiplies a dequantized copy then)."""
    if (not folds_products(p)
            or any(t is not None and (type(t) is not torch.Tensor or t.shape != p.shape
                                      or t.dtype != p.dtype or not t.is_contiguous()
                                      or not t.is_cpu) for t in (other, out))):
        return None
    if out is None:
        out = empty_cpu(p.numel(), p.dtype).view(p.shape)
    return _unpack_into(p, out, other)
