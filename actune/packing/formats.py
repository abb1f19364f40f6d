"""The packed formats: what a quantized, masked or coded tensor is stored as.

Plain data, no kernels: the front end (:mod:`actune.packing.tensors`) makes and reads them
through the backends, and dispatches on their type.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

__all__ = ["PackedCodes", "PackedColumns", "PackedMask", "PackedRows", "PackedSamples",
           "PackedTensor"]


@dataclass(frozen=True)
class PackedTensor:
    """A tensor quantized to ``bits`` per element, in groups of ``group_size``.

    ``codes`` holds the packed codes, ``meta`` two 16-bit words per group (see
    ``actune_kernels.layout``); ``shape``, ``dtype`` and ``stride`` describe the original tensor.
    In an estimate's simulated offload ``meta`` is None and ``codes`` a fake buffer of every
    byte (one allocation each way instead of two).
    """

    codes: torch.Tensor
    meta: torch.Tensor | None
    bits: int
    group_size: int
    shape: torch.Size
    dtype: torch.dtype
    stride: tuple[int, ...]
    zero_code: bool = False
    #: packed one feature at a time (:class:`PackedColumns`)
    by_feature: ClassVar[bool] = False

    @property
    def nbytes(self) -> int:
        """Every byte held: codes and metadata."""
        return self.codes.nbytes + (0 if self.meta is None else self.meta.nbytes)

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def bits_per_element(self) -> float:
        """Stored bits per original element, metadata and padding included."""
        return 8 * self.nbytes / max(self.numel(), 1)


@dataclass(frozen=True)
class PackedColumns(PackedTensor):
    """A features-last tensor packed by feature in the CPU kernels' column layout
    (:mod:`actune_kernels.cpu_columns`): blocks of ``group_size`` rows, each feature of a block
    one group, codes in memory order. Dequantized row-major (:mod:`actune.packing.columns`)."""

    by_feature: ClassVar[bool] = True


@dataclass(frozen=True)
class PackedSamples:
    """A tensor whose samples (along dim 0) were quantized with different bits: ``parts``
    holds, per bit width, the indices of its samples and their packed rows, each row in the
    tensor's memory order; ``stride``: that order where it is not row-major (a features-last
    copy, a channels-last input), None where it is."""

    parts: tuple[tuple[torch.Tensor, PackedTensor], ...]
    shape: torch.Size
    dtype: torch.dtype
    stride: tuple[int, ...] | None = None

    @property
    def nbytes(self) -> int:
        return sum(idx.nbytes + p.nbytes for idx, p in self.parts)

    @property
    def device(self) -> torch.device:
        return self.parts[0][1].device


@dataclass(frozen=True)
class PackedRows:
    """A tensor whose samples (rows along dim 0, whole groups each) were packed with their
    own bits into one buffer: row ``r`` at ``row_bits[r]`` bits from byte ``row_offset[r]``.
    Each row's codes and metadata are those :func:`quantize` gives the whole tensor at that
    width (the CPU kernels' per-row variant: no copies)."""

    codes: torch.Tensor
    meta: torch.Tensor
    row_bits: torch.Tensor
    row_offset: torch.Tensor
    group_size: int
    shape: torch.Size
    dtype: torch.dtype
    stride: tuple[int, ...]
    zero_code: bool = False

    @property
    def nbytes(self) -> int:
        return (self.codes.nbytes + self.meta.nbytes + self.row_bits.nbytes
                + self.row_offset.nbytes)

    @property
    def device(self) -> torch.device:
        return self.codes.device


@dataclass(frozen=True)
class PackedMask:
    """A boolean tensor stored at 1 bit per element (exact)."""

    bits8: torch.Tensor
    shape: torch.Size

    @property
    def nbytes(self) -> int:
        return self.bits8.nbytes

    @property
    def device(self) -> torch.device:
        return self.bits8.device


@dataclass(frozen=True)
class PackedCodes:
    """Small integer codes (each below ``2 ** bits``) stored at ``bits`` per element, exact.
    With ``levels`` they stand for values (a codebook's: :mod:`actune.packing.codebooks`), code
    ``k``
    for ``levels[k]`` in ``dtype``: :func:`dequantize_codes` reads them back so."""

    bytes8: torch.Tensor
    shape: torch.Size
    bits: int
    levels: tuple[float, ...] | None = None
    dtype: torch.dtype | None = None

    @property
    def nbytes(self) -> int:
        return self.bytes8.nbytes

    @property
    def device(self) -> torch.device:
        return self.bytes8.device

