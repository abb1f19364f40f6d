"""quantize() / dequantize(): the front end of the packed format.

:func:`quantize` packs a tensor along its memory order (:class:`PackedTensor`) or, asked to
pack by feature, in the column layout (:class:`PackedColumns`, :mod:`actune.packing.columns`);
:func:`dequantize` dispatches on the packed value's type. The front end imports the backends,
never the reverse.
"""

from __future__ import annotations

from math import prod

import torch

from actune import tunables
from actune.packing import columns
from actune.packing.formats import PackedColumns, PackedTensor
from actune.packing.kernels import (
    COMPILE,
    KERNEL_DTYPES,
    compiling,
    fake_pack,
    pack_flat,
    pack_op,
    plain,
    shapes_only,
    storage_order,
    unpack_cpu,
    unpack_flat,
    unpack_op,
)
from actune_kernels import layout

__all__ = ["check_arguments", "dequantize", "dequantize_into", "group_steps", "memory_order",
           "quantize", "quantize_checked"]

_new = object.__new__


def check_arguments(x: torch.Tensor, bits: int, group_size: int, seed: int | None,
                    zero_code: bool) -> None:
    """Raise ``TypeError`` / ``ValueError`` naming what to fix in :func:`quantize`'s
    arguments."""
    layout.check_bits(bits)
    layout.check_group_size(group_size)
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"quantize expects a floating-point tensor, got {type(x).__name__}"
                        + (f" of {x.dtype}" if isinstance(x, torch.Tensor) else ""))
    if seed is not None and not 0 <= seed < 2**62:
        raise ValueError(f"seed must be in [0, 2**62), got {seed}")
    if zero_code and bits < 2:
        raise ValueError("zero_code needs at least 2 bits (code 0 is taken by the zeros)")


def quantize(x: torch.Tensor, bits: int, *, group_size: int = layout.DEFAULT_GROUP_SIZE,
             seed: int | None = None, stochastic: bool = True,
             zero_code: bool = False) -> PackedTensor:
    """Quantize a floating tensor to ``bits`` (1, 2, 4 or 8) per element.

    Groups of ``group_size`` consecutive elements (in memory order) share a 16-bit minimum and
    step. Stochastic rounding (the default) is unbiased: ``E[dequantize(quantize(x))] == x``.
    ``seed`` fixes the rounding; by default it is drawn from torch's default generator, so
    ``torch.manual_seed`` makes runs repeatable. ``stochastic=False`` rounds to nearest.
    Dense layouts (contiguous, channels_last, any permutation) are packed without a copy and
    restored by :func:`dequantize`; other strided tensors are copied first. Groups holding NaN
    or inf dequantize to NaN.

    ``zero_code=True`` (for tensors >= 0, such as ReLU outputs; 2 bits or more) reserves code 0
    for exact zeros: ``dequantize(p) > 0`` is then exactly ``x > 0``, still unbiased.
    """
    check_arguments(x, bits, group_size, seed, zero_code)
    return quantize_checked(x, bits, group_size, -1 if seed is None else seed, stochastic,
                            zero_code)


def quantize_checked(x: torch.Tensor, bits: int, group_size: int, seed: int,
                     stochastic: bool = True, zero_code: bool = False,
                     by_feature: bool = False) -> PackedTensor:
    """:func:`quantize` for a caller that has checked its arguments (the saved-tensor hooks,
    whose level checked its widths): ``seed`` < 0 draws one. ``by_feature``: pack a
    features-last tensor by feature (a group holds one feature's values; on the CPU the
    column layout, elsewhere a feature-major copy: :mod:`actune.packing.columns`)."""
    if by_feature and columns.feature_order(x) is not None:
        if columns.in_columns(x):
            return columns.quantize_columns(x, bits, group_size, seed, stochastic, zero_code)
        # elsewhere a feature-major copy, dequantized in that layout
        x = columns.feature_major(x.detach())
    if type(x) is torch.Tensor and x.is_contiguous() and not COMPILE._is_compiling_flag:
        # the common case, with no flat view to make
        codes, meta = pack_flat(x.detach(), bits, group_size, seed, stochastic, zero_code)
        p = _new(PackedTensor)  # (the frozen dataclass's own __init__ sets each field by a call)
        p.__dict__.update(codes=codes, meta=meta, bits=bits, group_size=group_size,
                          shape=x.shape, dtype=x.dtype, stride=x.stride(), zero_code=zero_code)
        return p
    if shapes_only(x) and x.is_contiguous():  # an estimate: no detach, no flat view
        codes, meta = fake_pack(x, bits, group_size, 0, stochastic, zero_code)
        return PackedTensor(codes, meta, bits, group_size, x.shape, x.dtype, tuple(x.stride()),
                            zero_code)
    flat, stride = memory_order(x)
    pack = fake_pack if shapes_only(x) else pack_flat if plain(x) else pack_op
    codes, meta = pack(flat, bits, group_size, seed, stochastic, zero_code)
    return PackedTensor(codes, meta, bits, group_size, x.shape, x.dtype, stride, zero_code)


def memory_order(x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """``x``'s elements as a 1-D tensor in memory order (a view when ``x`` is dense in any
    layout, else a row-major copy) and the strides :func:`dequantize` restores."""
    x = x.detach()
    dense = storage_order(x)
    if dense is None:  # overlapping or with gaps: pack a row-major copy
        dense = x.contiguous()
        return dense.reshape(-1), tuple(dense.stride())
    return dense.reshape(-1), tuple(x.stride())


def dequantize(p: PackedTensor) -> torch.Tensor:
    """The tensor ``p`` was made from, up to quantization error: same shape, dtype, device and
    memory layout (strides; a :class:`PackedColumns` value comes back row-major)."""
    return _DEQUANTIZERS[type(p)](p)


def _dequantize_flat(p: PackedTensor) -> torch.Tensor:
    codes = p.codes
    if type(codes) is torch.Tensor and not COMPILE._is_compiling_flag:  # the common case
        dtype = p.dtype
        n = prod(p.shape)
        if (codes.is_cpu and dtype in KERNEL_DTYPES and 0 < n * dtype.itemsize
                < tunables.HUGE_OUTPUT_BYTES):
            out = torch.empty_strided(p.shape, p.stride, dtype=dtype)  # written in its layout
            unpack_cpu(codes, p.meta, p.bits, p.group_size, out, n, p.zero_code)
            return out
        return unpack_flat(codes, p.meta, p.bits, p.group_size, n, dtype,
                            p.zero_code).as_strided(p.shape, p.stride)
    if shapes_only(codes):  # an estimate: the output's storage in one operation
        return codes.new_empty_strided(p.shape, p.stride, dtype=p.dtype)
    unpack = unpack_flat if plain(codes) else unpack_op
    flat = unpack(p.codes, p.meta, p.bits, p.group_size, p.numel(), p.dtype, p.zero_code)
    out = flat.as_strided(p.shape, p.stride)
    return out


#: The dequantizer of each packed type (the front end's dispatch: backends never import it).
_DEQUANTIZERS = {PackedTensor: _dequantize_flat, PackedColumns: columns.dequantize_columns}


def dequantize_into(p: PackedTensor, out: torch.Tensor) -> torch.Tensor:
    """:func:`dequantize` written into ``out`` (``p``'s shape and dtype, contiguous), in place
    of a new tensor: on the CPU the kernel fills it directly (no allocation to fault in: half
    the time of dequantize-then-copy for 16 MiB), elsewhere a copy. Returns ``out``."""
    if (p.shape != out.shape or p.dtype != out.dtype or not out.is_contiguous()
            or out.device != p.codes.device):
        raise ValueError(f"dequantize_into needs a contiguous {p.dtype} tensor of shape "
                         f"{tuple(p.shape)} on {p.codes.device}, got {out.dtype} "
                         f"{tuple(out.shape)} on {out.device}")
    if (not p.by_feature and type(p.codes) is torch.Tensor and p.codes.is_cpu
            and p.dtype in KERNEL_DTYPES and not compiling()
            and p.stride == out.stride()):
        unpack_cpu(p.codes, p.meta, p.bits, p.group_size, out, out.numel(), p.zero_code)
        return out
    return out.copy_(dequantize(p))


def group_steps(p: PackedTensor) -> torch.Tensor:
    """Each group's step between codes (float32; 0 for groups holding NaN or inf)."""
    word = p.meta[:, 1]
    magnitude = word & 0x7FFF
    half = magnitude.view(torch.float16).float()
    brain = magnitude.view(torch.bfloat16).float()
    steps = torch.where(word < 0, brain, half)  # the sign bit names the grid (see layout)
    return torch.nan_to_num(steps, nan=0.0, posinf=0.0)

