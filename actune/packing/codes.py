"""Small integer codes at 1-8 bits per element (exact), and the values they stand for."""

from __future__ import annotations

import functools
import math

import torch

from actune.packing.formats import PackedCodes
from actune.packing.kernels import compiling

__all__ = ["CODE_BITS", "dequantize_codes", "pack_codes", "unpack_codes"]


CODE_BITS = (1, 2, 4, 8)


def pack_codes(codes: torch.Tensor, bits: int, levels: tuple[float, ...] | None = None,
               dtype: torch.dtype | None = None) -> PackedCodes:
    """Pack unsigned 8-bit ``codes`` (each below ``2 ** bits``) at ``bits`` per element, the
    first code of each byte in its low bits; ``levels`` and ``dtype``: the values they stand
    for (see :class:`PackedCodes`). Plain tensor ops: any device, fake tensors too."""
    if bits not in CODE_BITS:
        raise ValueError(f"codes are packed at {CODE_BITS} bits, not {bits}")
    if levels is not None and len(levels) > 2 ** bits:
        raise ValueError(f"{len(levels)} levels do not fit {bits}-bit codes")
    flat = codes.detach().reshape(-1)
    if bits == 8:
        return PackedCodes(flat.clone(), codes.shape, bits, levels, dtype)
    per = 8 // bits
    pad = (-flat.numel()) % per
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    # one strided column per position in the byte (each pass over a byte's worth of codes,
    # not a shifted copy of every code)
    columns = flat.view(-1, per)
    bytes8 = columns[:, 0].clone()
    for j in range(1, per):
        bytes8 |= columns[:, j] << (j * bits)
    return PackedCodes(bytes8, codes.shape, bits, levels, dtype)


def unpack_codes(p: PackedCodes) -> torch.Tensor:
    """The unsigned 8-bit codes ``p`` was packed from."""
    if p.bits == 8:
        return p.bytes8.view(p.shape)
    n = math.prod(p.shape)
    shifts = torch.arange(0, 8, p.bits, dtype=torch.uint8, device=p.bytes8.device)
    codes = (p.bytes8.unsqueeze(1) >> shifts) & ((1 << p.bits) - 1)
    return codes.view(-1)[:n].view(p.shape)


def dequantize_codes(p: PackedCodes) -> torch.Tensor:
    """The values ``p``'s codes stand for (``p.levels`` in ``p.dtype``), read a byte at a
    time: each byte's values from a table of all 256, one gather, no codes unpacked."""
    if p.levels is None or p.dtype is None:
        raise ValueError("these codes stand for no values: packed without levels")
    table = _byte_table(p.levels, p.bits, p.bytes8, p.dtype)
    n = math.prod(p.shape)
    out = table.index_select(0, p.bytes8.int()).view(-1)
    return (out[:n] if out.numel() > n else out).view(p.shape)


def _byte_table(levels: tuple[float, ...], bits: int, like: torch.Tensor,
                dtype: torch.dtype) -> torch.Tensor:
    """``[256, 8 // bits]``: each byte's values, its first code in the low bits; made once per
    device and dtype for real tensors, afresh for fake or traced ones."""
    if type(like) is not torch.Tensor or compiling():
        return torch.tensor(_table_values(levels, bits), dtype=dtype, device=like.device)
    return _real_table(levels, bits, like.device, dtype)


@functools.cache
def _real_table(levels: tuple[float, ...], bits: int, device: torch.device,
                dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(_table_values(levels, bits), dtype=dtype, device=device)


def _table_values(levels: tuple[float, ...], bits: int) -> list[list[float]]:
    per, mask = 8 // bits, (1 << bits) - 1
    padded = (*levels, *(levels[-1:] * ((1 << bits) - len(levels))))
    return [[padded[(byte >> (j * bits)) & mask] for j in range(per)] for byte in range(256)]

