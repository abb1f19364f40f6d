"""The Numba CPU kernels as custom ops for compiled graphs, keyed by a tensor.

A compiled graph cannot hold a seed as a Python number (it would be a constant of the graph:
the same rounding every step); these ops take the key as a 0-d tensor that the graph draws
from its generator each step (:func:`actune.traced.pack.random_key`). They pack in the
kernels' format: codes shaped ``(groups, group_size * bits // 8)`` and each group's two
metadata words viewed as one float32, ``(groups, 1)``, the shapes by which a compiled
graph's saved tensors are told apart (:func:`actune.traced.pack.packed_origin`). Flat groups
run along memory (:mod:`actune_kernels.cpu`); ``by_feature`` groups are ``group_size`` rows
of one feature in the column layout (:mod:`actune_kernels.cpu_columns`, features a multiple
of 8). CPU tensors of float32 or float64 only: :func:`supported` says which.
"""

from __future__ import annotations

import torch
from torch._prims_common import make_contiguous_strides_for

from actune.quant import _KERNEL_DTYPES, _NUMPY_DTYPES, PackedTensor, _cpu_kernels, dequantize
from actune.quant_columns import _column_kernels
from actune_kernels import layout

__all__ = ["USE_ON_CPU", "graph_pack", "graph_unpack", "supported"]

#: Compiled graphs pack CPU tensors with these ops rather than with torch ops that Inductor
#: fuses into their producers: on the CPU the kernels gave lower peaks on most models and
#: steps as fast (docs/benchmarks.md). False: the torch ops, a GPU's form, everywhere.
USE_ON_CPU = True


def supported(x: torch.Tensor, by_feature: bool) -> bool:
    """Can the kernels pack ``x`` in a graph: a CPU float32/float64 tensor, with features a
    multiple of 8 if ``by_feature``?"""
    return (x.device.type == "cpu" and x.dtype in _KERNEL_DTYPES
            and (not by_feature or (x.dim() >= 2 and x.shape[-1] % 8 == 0)))


def _groups(shape: torch.Size, group_size: int, by_feature: bool) -> int:
    if by_feature:
        width = shape[-1]
        return _column_kernels().column_groups(shape.numel() // width, width, group_size)
    return layout.num_groups(shape.numel(), group_size)


@torch.library.custom_op("actune::graph_pack", mutates_args=())
def graph_pack(x: torch.Tensor, bits: int, group_size: int, by_feature: bool,
               key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` rounded stochastically to ``bits`` per group, the stream keyed by ``key``:
    ``(codes, metadata)`` as the module docstring shapes them."""
    groups = _groups(x.shape, group_size, by_feature)
    codes = torch.empty((groups, group_size * bits // 8), dtype=torch.uint8)
    meta = torch.empty((groups, 2), dtype=torch.int16)
    if groups:
        src = x.contiguous()
        seed = int(key)
        if by_feature:
            width = x.shape[-1]
            _column_kernels().pack_columns_at(
                src.data_ptr(), x.numel() // width, width, _NUMPY_DTYPES[src.dtype],
                codes.data_ptr(), meta.data_ptr(), bits, group_size, seed)
        else:
            _cpu_kernels().pack_at(src.data_ptr(), x.numel(), _NUMPY_DTYPES[src.dtype],
                                   codes.data_ptr(), meta.data_ptr(), bits, group_size, seed,
                                   0, True, False)
    return codes, meta.view(torch.float32)


@graph_pack.register_fake
def _fake_pack(x, bits, group_size, by_feature, key):
    groups = _groups(x.shape, group_size, by_feature)
    return (x.new_empty((groups, group_size * bits // 8), dtype=torch.uint8),
            x.new_empty((groups, 1), dtype=torch.float32))


@torch.library.custom_op("actune::graph_unpack", mutates_args=())
def graph_unpack(codes: torch.Tensor, meta: torch.Tensor, bits: int, group_size: int,
                 by_feature: bool, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
    """The values :func:`graph_pack` kept, as a tensor of ``shape`` and ``dtype``
    (:func:`actune.quant.dequantize` of them: the same kernels)."""
    size = torch.Size(shape)
    packed = PackedTensor(codes.reshape(-1), meta.view(torch.int16), bits, group_size, size,
                          dtype, tuple(make_contiguous_strides_for(size)), False, by_feature)
    return dequantize(packed)


@graph_unpack.register_fake
def _fake_unpack(codes, meta, bits, group_size, by_feature, shape, dtype):
    return codes.new_empty(shape, dtype=dtype)
