"""The Numba CPU kernels as custom ops for compiled graphs, keyed by a tensor (and a ReLU
mask's unpacking, :data:`graph_unpack_bits`, as an op Inductor does not fuse).

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

from actune.packing.columns import column_kernels, unpack_columns_into
from actune.packing.kernels import KERNEL_DTYPES, NUMPY_DTYPES, cpu_kernels, unpack_cpu
from actune_kernels import layout

__all__ = ["graph_pack", "graph_unpack", "supported"]


def supported(x: torch.Tensor, by_feature: bool) -> bool:
    """Can the kernels pack ``x`` in a graph: a CPU float32/float64 tensor, with features a
    multiple of 8 if ``by_feature``?"""
    return (x.device.type == "cpu" and x.dtype in KERNEL_DTYPES
            and (not by_feature or (x.dim() >= 2 and x.shape[-1] % 8 == 0)))


def _groups(shape: torch.Size, group_size: int, by_feature: bool) -> int:
    if by_feature:
        width = shape[-1]
        return column_kernels().column_groups(shape.numel() // width, width, group_size)
    return layout.num_groups(shape.numel(), group_size)


# Defined with ``torch.library.Library`` rather than ``torch.library.custom_op``: the
# dispatcher calls these Python kernels straight, where ``custom_op``'s wrappers (autograd,
# aliasing checks) cost more per call than the kernels on small tensors, once per saved tensor.
# Nothing differentiates through them (the traced rules' backward unpacks).
_LIB = torch.library.Library("actune", "FRAGMENT")
_LIB.define("graph_pack(Tensor x, int bits, int group_size, bool by_feature, Tensor key) "
            "-> (Tensor, Tensor)")
_LIB.define("graph_unpack(Tensor codes, Tensor meta, int bits, int group_size, "
            "bool by_feature, int[] shape, ScalarType dtype) -> Tensor")
_LIB.define("graph_unpack_bits(Tensor bits, int numel) -> Tensor")


def _pack(x: torch.Tensor, bits: int, group_size: int, by_feature: bool,
          key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    groups = _groups(x.shape, group_size, by_feature)
    codes = torch.empty((groups, group_size * bits // 8), dtype=torch.uint8)
    meta = torch.empty((groups, 1), dtype=torch.float32)  # (two int16 words a group)
    if groups:
        src = x.contiguous()
        seed = int(key)
        if by_feature:
            width = x.shape[-1]
            column_kernels().pack_columns_at(
                src.data_ptr(), x.numel() // width, width, NUMPY_DTYPES[src.dtype],
                codes.data_ptr(), meta.data_ptr(), bits, group_size, seed)
        else:
            cpu_kernels().pack_at(src.data_ptr(), x.numel(), NUMPY_DTYPES[src.dtype],
                                   codes.data_ptr(), meta.data_ptr(), bits, group_size, seed,
                                   0, True, False)
    return codes, meta


def _fake_pack(x, bits, group_size, by_feature, key):
    groups = _groups(x.shape, group_size, by_feature)
    return (x.new_empty((groups, group_size * bits // 8), dtype=torch.uint8),
            x.new_empty((groups, 1), dtype=torch.float32))


def _unpack(codes: torch.Tensor, meta: torch.Tensor, bits: int, group_size: int,
            by_feature: bool, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
    work = dtype if dtype in KERNEL_DTYPES else torch.float32  # (the kernels write these)
    out = torch.empty(shape, dtype=work)
    if out.numel():  # the kernels straight into the output
        if by_feature:
            unpack_columns_into(codes, meta, bits, group_size, out, shape[-1])
        else:
            unpack_cpu(codes, meta, bits, group_size, out, out.numel(), False)
    return out if work == dtype else out.to(dtype)


def _fake_unpack(codes, meta, bits, group_size, by_feature, shape, dtype):
    return codes.new_empty(shape, dtype=dtype)


#: Each byte's eight bits as eight bools, one int64 a byte: a mask unpacks by one gather
#: (faster than a broadcast shift and a mask).
_BYTE_BITS = ((torch.arange(256, dtype=torch.uint8).unsqueeze(1)
               >> torch.arange(8, dtype=torch.uint8)) & 1).bool().view(torch.int64).reshape(256)


def _unpack_bits(bits: torch.Tensor, numel: int) -> torch.Tensor:
    return _BYTE_BITS.index_select(0, bits.int()).view(torch.bool)[:numel]


def _fake_unpack_bits(bits, numel):
    return bits.new_empty((numel,), dtype=torch.bool)


_LIB.impl("graph_unpack_bits", _unpack_bits, "CPU")
torch.library.register_fake("actune::graph_unpack_bits", _fake_unpack_bits, lib=_LIB)
_LIB.impl("graph_pack", _pack, "CPU")
_LIB.impl("graph_unpack", _unpack, "CPU")
torch.library.register_fake("actune::graph_pack", _fake_pack, lib=_LIB)
torch.library.register_fake("actune::graph_unpack", _fake_unpack, lib=_LIB)

#: ``graph_pack(x, bits, group_size, by_feature, key) -> (codes, metadata)``: ``x`` rounded
#: stochastically to ``bits`` per group, the stream keyed by ``key`` (shapes: module
#: docstring).
graph_pack = torch.ops.actune.graph_pack.default
#: ``graph_unpack(codes, metadata, bits, group_size, by_feature, shape, dtype)``: the values
#: :data:`graph_pack` kept, as a contiguous tensor of ``shape`` and ``dtype``.
graph_unpack = torch.ops.actune.graph_unpack.default
#: ``graph_unpack_bits(bits, numel)``: the first ``numel`` bits of a mask packed eight
#: neighbours a byte (``actune.traced.convolutions.pack_bits``), as a bool tensor. An opaque
#: op on the CPU: fused into its readers, the shift by each element's position in its byte
#: kept Inductor's C++ kernels from vectorising them.
graph_unpack_bits = torch.ops.actune.graph_unpack_bits.default
