"""``F.grid_sample`` keeping its grid exact and its input rounded, or nothing of its input
(:class:`PackedGridSample`), and what the eager and the traced forms share: the call's
arguments checked and numbered as PyTorch's kernels number them, and PyTorch's backward kernel.

Its input gradient scatters the output gradient with weights computed from the grid alone;
its grid gradient is linear in the input (the differences of the neighbouring values each
sample interpolates), so a rounded copy keeps it unbiased. The grid stays exact: which values
are read, and their weights, are nonlinear in it."""

from __future__ import annotations

from typing import NamedTuple

import torch

from actune.packing.saved import check_double_backward, take
from actune.substitutes.functions import arg

__all__ = ["GridSampleCall", "PackedGridSample", "grid_sample_backward", "grid_sample_call",
           "reads_input"]

#: ``F.grid_sample``'s modes and padding modes as ``torch.grid_sampler`` numbers them.
_MODES = {"bilinear": 0, "nearest": 1, "bicubic": 2}
_PADDINGS = {"zeros": 0, "border": 1, "reflection": 2}
_NEAREST = _MODES["nearest"]


class GridSampleCall(NamedTuple):
    """An ``F.grid_sample`` call's arguments, its mode and padding as PyTorch's kernels number
    them (what :class:`PackedGridSample` and the traced form take, in this order)."""

    x: torch.Tensor
    grid: torch.Tensor
    mode: int
    padding: int
    align_corners: bool


def grid_sample_call(args: tuple, kwargs: dict) -> GridSampleCall | None:
    """The arguments of an ``F.grid_sample`` call that a rule can take (a 4-d or 5-d input, a
    tensor grid, a mode and padding PyTorch names), numbered; else None."""
    x, grid = args[0], arg(args, kwargs, 1, "grid", None)
    mode = _MODES.get(arg(args, kwargs, 2, "mode", "bilinear"))
    padding = _PADDINGS.get(arg(args, kwargs, 3, "padding_mode", "zeros"))
    align_corners = arg(args, kwargs, 4, "align_corners", None)
    if (not isinstance(x, torch.Tensor) or not isinstance(grid, torch.Tensor)
            or x.dim() not in (4, 5) or mode is None or padding is None
            or not isinstance(align_corners, bool | None)):
        return None
    return GridSampleCall(x, grid, mode, padding, bool(align_corners))


def reads_input(mode: int, grid_needs_grad: bool) -> bool:
    """Does backward read the input's values? Only the grid's gradient does, and not in the
    ``nearest`` mode (whose grid gradient is zero)."""
    return grid_needs_grad and mode != _NEAREST


def grid_sample_backward(grad: torch.Tensor, x: torch.Tensor | None, shape: torch.Size,
                         grid: torch.Tensor, mode: int, padding: int, align_corners: bool,
                         needs: tuple[bool, bool]) -> tuple:
    """PyTorch's backward kernel of ``torch.grid_sampler`` in ``grad``'s dtype (the op's own:
    autocast may have run it wider than its inputs): ``x`` the input's values, or None where
    only its gradient is asked (which reads its ``shape`` alone)."""
    dtype = grad.dtype
    x = (torch.zeros((), dtype=dtype, device=grad.device).expand(shape) if x is None
         else x.to(dtype))
    kernel = (torch.ops.aten.grid_sampler_2d_backward if len(shape) == 4
              else torch.ops.aten.grid_sampler_3d_backward)
    return kernel(grad, x, grid.to(dtype), mode, padding, align_corners, list(needs))


class PackedGridSample(torch.autograd.Function):
    """``F.grid_sample`` keeping its grid exact and its input at ``bits``, or nothing of the
    input where no grid gradient reads it (see the module docstring)."""

    @staticmethod
    def forward(ctx, x, grid, mode, padding, align_corners, bits, session):
        reads = reads_input(mode, ctx.needs_input_grad[1])
        if reads:
            ctx.x = session.packer.pack_fixed(x, bits, "grid_sample input", replaces=(x,))
        else:
            session.accounting.count(x)  # (what PyTorch keeps; nothing kept here)
        ctx.save_for_backward(grid)  # (exact: the rule's label names it)
        ctx.conf = (mode, padding, align_corners, x.shape, reads)
        return torch.grid_sampler(x, grid, mode, padding, align_corners)

    @staticmethod
    def backward(ctx, grad):
        check_double_backward()
        (grid,) = ctx.saved_tensors
        mode, padding, align_corners, shape, reads = ctx.conf
        x = take(ctx, "x").get() if reads else None
        gx, ggrid = grid_sample_backward(grad, x, shape, grid, mode, padding, align_corners,
                                         ctx.needs_input_grad[:2])
        return gx, ggrid, None, None, None, None, None

