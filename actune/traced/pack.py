"""Per-group stochastic rounding written in torch ops, for compiled graphs.

The quantization of the Numba kernels (:mod:`actune.packing.tensors`): ``group_size`` elements
share a
minimum and a step, each element is rounded up with probability equal to its fractional
position between the two codes around it (unbiased), and ``8 // bits`` codes share a byte. The
byte layout is this module's own. Written in torch ops so that Dynamo traces it and Inductor
fuses it into the kernels around it; its random numbers come from the graph's generator.
Knows nothing of modules.

Groups run along the flattened tensor, or with ``by_feature`` along the tokens of one feature
of the last dim (a strided view: no transposed copy). :func:`pack_range` rounds a tensor whose
range is known in advance (an activation's derivative) in one pass, with no statistics.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F  # noqa: N812

from actune import tunables
from actune.packing import graph_ops
from actune_kernels.scalar import MASK32, MUL1, MUL2

__all__ = ["Packed", "group_statistic", "in_memory_order", "join_codes", "memory_order", "pack",
           "pack_range", "packed_bytes", "packed_origin", "random_key", "restore_order",
           "split_codes", "uniform", "unpack", "unpack_range"]


class Packed(NamedTuple):
    """A tensor packed by :func:`pack`: codes (uint8), and per group its minimum and step
    (float32)."""

    codes: torch.Tensor
    low: torch.Tensor
    step: torch.Tensor | None


def memory_order(x: torch.Tensor) -> tuple[int, ...] | None:
    """The order of ``x``'s dims from the slowest in memory to the fastest, where it is dense
    in another order than its own (channels-last): ``x.permute(order)`` is then contiguous, a
    view. None where ``x`` is contiguous or not dense. Flat groups are packed in memory order,
    so that a channels-last tensor is neither copied to pack nor unpacked in another layout
    than the kernels around it use (each such mix made Inductor transpose between them)."""
    if x.dim() < 2 or x.is_contiguous():
        return None
    order = tuple(sorted(range(x.dim()), key=lambda d: (-x.stride(d), d)))
    return order if x.permute(order).is_contiguous() else None


def in_memory_order(x: torch.Tensor, order: tuple[int, ...] | None) -> torch.Tensor:
    """``x`` as the contiguous view :func:`memory_order` names (``x`` where None)."""
    return x if order is None else x.permute(order)


def restore_order(y: torch.Tensor, order: tuple[int, ...] | None) -> torch.Tensor:
    """The inverse of :func:`in_memory_order`: ``y`` (contiguous, dims in ``order``) as a view
    in the original dims' order, with the original's strides."""
    if order is None:
        return y
    inverse = [0] * len(order)
    for i, d in enumerate(order):
        inverse[d] = i
    return y.permute(inverse)


def _groups(x: torch.Tensor, group_size: int, by_feature: bool) -> torch.Tensor:
    """``x`` as float32 groups along dim 1: ``(groups, group_size)``, or with ``by_feature``
    ``(token blocks, group_size, features)``; zero-padded to whole groups."""
    if by_feature:
        rows = x.reshape(-1, x.shape[-1]).float()
        pad = -rows.shape[0] % group_size
        if pad:
            rows = F.pad(rows, (0, 0, 0, pad))
        return rows.reshape(-1, group_size, rows.shape[-1])
    flat = x.reshape(-1).float()
    pad = -flat.numel() % group_size
    if pad:
        flat = F.pad(flat, (0, pad))
    return flat.reshape(-1, group_size)


def random_key(device: torch.device) -> torch.Tensor:
    """A fresh key for :func:`uniform` from the graph's generator (a 0-d int64 tensor)."""
    return torch.randint(0, 2**31, (), dtype=torch.int64, device=device)


def uniform(like: torch.Tensor, key: torch.Tensor | None = None) -> torch.Tensor:
    """Uniform numbers in [0, 1) on a 2**-24 grid, one per element of ``like``: the Numba
    kernels' counter-based stream (a 32-bit hash of the element's index and a key, 24 bits
    kept; ``actune_kernels.scalar.random24_u32``), with ``key`` (the same key, the same numbers:
    a dropout mask drawn again in backward) or a fresh one from the graph's generator
    (:func:`random_key`). In 32-bit integers, products wrapping and shifts masked to act as
    unsigned: Inductor fuses and vectorises it, where ``rand_like``'s Philox is not
    (docs/benchmarks.md, "torch.compile"). A backend that does not fuse (``aot_eager``)
    holds its integer temporaries, 8 bytes an element, while it runs."""
    wide = like.numel() >= 2**31
    itype = torch.int64 if wide else torch.int32
    key = (random_key(like.device) if key is None else key).to(itype)
    x = torch.arange(like.numel(), dtype=itype, device=like.device).reshape(like.shape) ^ key
    if wide:
        x = x & MASK32
    x = x ^ ((x >> 16) & 0xFFFF)
    x = _wrap(x * MUL1, wide)
    x = x ^ ((x >> 15) & 0x1FFFF)
    x = _wrap(x * MUL2, wide)
    x = x ^ ((x >> 16) & 0xFFFF)
    return ((x >> 8) & 0xFFFFFF).to(torch.float32) * (1.0 / (1 << 24))


def _wrap(x: torch.Tensor, wide: bool) -> torch.Tensor:
    """A product's low 32 bits (int32 products wrap by themselves)."""
    return x & MASK32 if wide else x


def _round(scaled: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes of ``scaled`` (in [0, 2**bits - 1]) rounded stochastically, ``8 // bits`` per
    byte along dim 1: a group of ``n`` values is ``8 // bits`` slices of ``n * bits // 8``,
    and byte ``j`` holds element ``j`` of each slice (slice ``i`` at bits ``i * bits``), so
    that packing and unpacking read and write whole rows, which Inductor vectorises (a byte
    of neighbours made it gather)."""
    top = 2**bits - 1
    q = torch.floor(scaled + uniform(scaled)).clamp_(0, top).to(torch.uint8)
    return join_codes(q, bits)


def join_codes(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes ``q`` (uint8, ``(groups, group_size, ...)``, each below ``2 ** bits``) joined
    ``8 // bits`` to a byte along dim 1, as :func:`pack` keeps them; :func:`split_codes`
    undoes it."""
    per = 8 // bits
    if per == 1:
        return q
    # the codes of a byte joined by a sum over their own small dim: a reduction Inductor
    # computes from ``scaled`` inside its loop, where joining slices made it keep every code
    # as a float first (a tensor the size of the input)
    q = q.reshape(q.shape[0], per, q.shape[1] // per, *q.shape[2:])
    return (q << _shifts(bits, q.dim() - 2, q.device)).sum(1, dtype=torch.uint8)


def _shifts(bits: int, trailing: int, device: torch.device) -> torch.Tensor:
    """Each slice's bit offset, shaped to broadcast over ``trailing`` dims after it."""
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=device)
    return shifts.reshape(8 // bits, *([1] * trailing))


def split_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """The codes :func:`join_codes` joined, one an element, as float32."""
    return _codes(codes, bits)


def _codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of :func:`_round`'s byte packing: one code per element, as float32 (each
    byte's codes by one broadcast shift, a pointwise op Inductor fuses into the reader)."""
    per = 8 // bits
    if per == 1:
        return codes.float()
    q = (codes.unsqueeze(1) >> _shifts(bits, codes.dim() - 1, codes.device)) & (2**bits - 1)
    return q.reshape(q.shape[0], per * q.shape[2], *q.shape[3:]).float()


def _restore(values: torch.Tensor, shape: torch.Size, dtype: torch.dtype,
             by_feature: bool) -> torch.Tensor:
    if by_feature:
        return values.reshape(-1, shape[-1])[: shape.numel() // shape[-1]].reshape(shape) \
            .to(dtype)
    return values.reshape(-1)[: shape.numel()].reshape(shape).to(dtype)


def pack(x: torch.Tensor, bits: int, group_size: int = 256, by_feature: bool = False,
         kernels: bool | None = None) -> Packed:
    """Round ``x`` stochastically to ``bits`` (1, 2, 4 or 8) per group; see :func:`unpack`.
    On the CPU (float32 and float64; by feature, features a multiple of 8) the Numba kernels
    pack, as one opaque op (:mod:`actune.packing.graph_ops`): ``step`` is then None and ``low``
    holds the groups' metadata words. ``kernels``: False for the torch ops everywhere (True
    where they cannot run raises)."""
    if kernels is None:
        kernels = tunables.GRAPH_OPS_ON_CPU and graph_ops.supported(x, by_feature)
    if kernels:
        codes, meta = graph_ops.graph_pack(x.detach(), bits, group_size, by_feature,
                                           random_key(x.device))
        return Packed(codes, meta, None)
    g = _groups(x.detach(), group_size, by_feature)
    low = g.amin(1, keepdim=True)
    step = (g.amax(1, keepdim=True) - low) / (2**bits - 1)
    scaled = (g - low) / torch.where(step > 0, step, torch.ones_like(step))
    return Packed(_round(scaled, bits), low, step)


def unpack(p: Packed | tuple, bits: int, shape: torch.Size, dtype: torch.dtype,
           group_size: int = 256, by_feature: bool = False,
           order: tuple[int, ...] | None = None) -> torch.Tensor:
    """The values :func:`pack` kept (a :class:`Packed` or its three tensors), as a tensor of
    ``shape`` and ``dtype`` (``group_size`` and ``by_feature`` as packed). ``order``: the
    :func:`memory_order` of a tensor packed as ``in_memory_order(x, order)``; the result then
    has ``x``'s shape and strides."""
    if order is not None:
        inner = unpack(p, bits, torch.Size(shape[d] for d in order), dtype, group_size,
                       by_feature)
        return restore_order(inner, order)
    codes, low, step = p
    if step is None:  # (the kernels' format)
        return graph_ops.graph_unpack(codes, low, bits, group_size, by_feature, list(shape),
                                      dtype)
    return _restore(_codes(codes, bits) * step + low, shape, dtype, by_feature)


def pack_range(x: torch.Tensor, bits: int, low: float, high: float,
               group_size: int = 256) -> torch.Tensor:
    """Codes of ``x``, whose values lie in ``[low, high]``, rounded stochastically on that
    fixed grid: one pass, no per-group statistics to compute or keep."""
    g = _groups(x.detach(), group_size, False)
    return _round((g - low) * ((2**bits - 1) / (high - low)), bits)


def unpack_range(codes: torch.Tensor, bits: int, low: float, high: float, shape: torch.Size,
                 dtype: torch.dtype) -> torch.Tensor:
    """The values :func:`pack_range` kept."""
    step = (high - low) / (2**bits - 1)
    return _restore(_codes(codes, bits) * step + low, shape, dtype, False)


def packed_bytes(numel: int, bits: int, group_size: int = 256) -> int:
    """Bytes :func:`pack` keeps for ``numel`` elements: codes plus two floats per group."""
    groups = -(-numel // group_size)
    return groups * (group_size * bits // 8 + 8)


def packed_origin(t: torch.Tensor, group_size: int = 256) -> tuple[int, int] | None:
    """``(elements, bits)`` that ``t`` stands for if it is codes :func:`pack` or
    :func:`pack_range` made (uint8, ``group_size * bits // 8`` bytes a group along dim 1), read
    off its shape; else None. How a compiled graph's saved tensors are told apart: at run time
    they carry nothing else."""
    if t.dtype == torch.uint8 and t.dim() > 2 and t.shape[1] == 1:
        t = t.squeeze(1)  # (the byte join's sum as the partitioner may save it: keepdim)
    if t.dtype != torch.uint8 or t.dim() < 2 or (8 * t.shape[1]) % group_size:
        return None
    bits = 8 * t.shape[1] // group_size
    if bits not in (1, 2, 4, 8):
        return None
    return t.numel() * 8 // bits, bits


def group_statistic(t: torch.Tensor) -> bool:
    """Is ``t`` shaped as :func:`pack`'s per-group minimum or step (float, one value per group
    along dim 1)?"""
    return t.is_floating_point() and t.dim() >= 2 and t.shape[1] == 1
