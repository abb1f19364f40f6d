"""Codebooks: a smooth activation's derivative kept as the index of its nearest level.

Rounding a derivative stochastically to a group's 2-bit grid is unbiased, but its noise is
large where the grid is coarse, and it reaches every gradient below the activation. Few-Bit
Backward (Novikov et al., ICML 2023) keeps instead, for each element, which of a few fixed
levels its derivative is nearest to: 2-3 bits, deterministic, no error in the forward, and a
smaller error than uniform rounding at the same width because the levels sit where the
derivative's values are dense. The levels here minimise the mean squared error of ``f'(X)``
for a standard normal ``X`` (Lloyd and Max's quantizer), found once per function and width.

Nothing here knows of modules or autograd: :class:`Codebook` encodes and decodes tensors;
:class:`actune.substitutes.functions.CodedDerivative` keeps an activation's derivative so.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from actune.packing.codes import dequantize_codes, pack_codes
from actune.packing.formats import PackedCodes

__all__ = ["WIDTHS", "Codebook", "fit", "gelu_codebook"]

#: The standard normal's mass outside +-GRID_EDGE is below 1e-14: the grid covers the rest.
GRID_EDGE = 8.0
GRID_POINTS = 20_001
#: At most this many Lloyd-Max iterations (they stop when the levels stop moving).
ITERATIONS = 1000


@dataclass(frozen=True)
class Codebook:
    """``2 ** bits`` levels, increasing; a value is kept as the index of its nearest."""

    levels: tuple[float, ...]
    bits: int

    def encode(self, values: torch.Tensor) -> torch.Tensor:
        """The index of each value's nearest level, as unsigned 8-bit codes: the number of
        cuts below the value (one comparison a cut, each a cheap pass: a search per element
        costs several times all of them at 2 bits)."""
        cuts = self.cuts
        codes = (values > cuts[0]).view(torch.uint8)
        for cut in cuts[1:]:
            codes += (values > cut).view(torch.uint8)
        return codes

    def pack(self, values: torch.Tensor) -> PackedCodes:
        """``values`` kept as their nearest levels' codes, at :attr:`bits` each
        (:func:`actune.packing.tensors.dequantize_codes` reads the levels back, in ``values``'
        dtype)."""
        return pack_codes(self.encode(values), self.bits, self.levels, values.dtype)

    def decode(self, codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The levels ``codes`` name, in ``dtype``."""
        return dequantize_codes(pack_codes(codes, self.bits, self.levels, dtype))

    @property
    def cuts(self) -> tuple[float, ...]:
        """The midpoints between neighbouring levels: where the nearest level changes."""
        return tuple((a + b) / 2 for a, b in zip(self.levels, self.levels[1:], strict=False))


def fit(derivative: Callable[[torch.Tensor], torch.Tensor], bits: int) -> Codebook:
    """The ``2 ** bits`` levels nearest, in mean square, to ``derivative(X)`` for a standard
    normal ``X``; ``derivative`` maps a float64 tensor of inputs to the derivative there.
    (A few milliseconds.) Runs on real CPU tensors whatever mode is active:
    the first call may come from an estimate on fake tensors or from a routed op."""
    with unset_fake_temporarily(), torch._C.DisableTorchFunction():
        return _fit(derivative, bits)


def _fit(derivative: Callable[[torch.Tensor], torch.Tensor], bits: int) -> Codebook:
    x = torch.linspace(-GRID_EDGE, GRID_EDGE, GRID_POINTS, dtype=torch.float64)
    values = derivative(x)
    # sorted once: each level's cell is then a run of the sorted values, its mass and moment
    # differences of cumulative sums
    values, order = values.sort()
    weight = torch.exp(-x * x / 2)[order]
    mass_below = torch.cat([weight.new_zeros(1), weight.cumsum(0)])
    moment_below = torch.cat([weight.new_zeros(1), (weight * values).cumsum(0)])
    count = 2 ** bits
    levels = torch.linspace(values[0].item(), values[-1].item(), count, dtype=torch.float64)
    ends = torch.tensor([len(values)])
    for _ in range(ITERATIONS):
        cuts = torch.searchsorted(values, (levels[1:] + levels[:-1]) / 2)
        bounds = torch.cat([ends.new_zeros(1), cuts, ends])
        mass = mass_below[bounds[1:]] - mass_below[bounds[:-1]]
        moment = moment_below[bounds[1:]] - moment_below[bounds[:-1]]
        # (a level no value is nearest to stays where it is)
        moved = torch.where(mass > 0, moment / mass.clamp_min(math.ulp(0.0)), levels)
        if torch.equal(moved, levels):
            break
        levels = moved
    return Codebook(tuple(levels.tolist()), bits)


#: The widths a derivative's codes may take: a byte holds a whole number of codes.
WIDTHS = (1, 2, 4)


def gelu_codebook(approximate: str, bits: int) -> Codebook:
    """GELU's derivative's ``2 ** bits`` levels (``approximate``: ``"none"`` or ``"tanh"``, as
    ``F.gelu`` takes; ``bits`` one of :data:`WIDTHS`), fitted at import: a compiled graph
    reads them as constants, with nothing to fit while it is traced."""
    return _GELU[approximate, bits]


def _gelu_derivative(approximate: str) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda x: torch.ops.aten.gelu_backward(torch.ones_like(x), x, approximate=approximate)


_GELU = {(approximate, bits): fit(_gelu_derivative(approximate), bits)
         for approximate in ("none", "tanh") for bits in WIDTHS}
