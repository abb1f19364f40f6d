"""Pooling and sampling: max pooling keeps each output's argmax as a one-byte offset in its
window (exact), not int64 input indices and not its input. Average pooling is linear and its
backward needs only the input's shape, yet PyTorch's keeps the whole input:
:class:`ShapeOnlyPool` keeps nothing. ``F.grid_sample`` (deformable attention's sampler, a
spatial transformer's) keeps its grid exact and its input rounded, or nothing of the input
where no grid gradient reads it (:class:`PackedGridSample`)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F  # noqa: N812

from actune.packing.saved import check_double_backward, plain_saving, take
from actune.rules.activations import compressible
from actune.rules.registry import register
from actune.substitutes.functions import OffsetMaxPool, arg, as_tuple

_AVERAGES = (F.avg_pool1d, F.avg_pool2d, F.avg_pool3d, F.adaptive_avg_pool1d,
             F.adaptive_avg_pool2d, F.adaptive_avg_pool3d)


@register(_AVERAGES, "pooling", None, "nothing: a linear op, backward needs only the shape")
def average_pool(s, func, args, kwargs, level):
    x = args[0]
    if level.exact or not x.is_floating_point() or x.numel() < level.min_numel:
        return None
    return ShapeOnlyPool.apply(x, func, args[1:], kwargs)


class ShapeOnlyPool(torch.autograd.Function):
    """A linear pooling op whose backward is its vector-Jacobian product at zeros: the same
    for every input, so nothing of the input is kept."""

    @staticmethod
    def forward(ctx, x, func, rest, kwargs):
        ctx.spec = (func, rest, kwargs, x.shape, x.dtype, x.device)
        return func(x, *rest, **kwargs)

    @staticmethod
    def backward(ctx, grad):
        check_double_backward()
        func, rest, kwargs, shape, dtype, device = ctx.spec
        if func is F.adaptive_avg_pool2d and len(shape) in (3, 4):  # as PyTorch's backward:
            if grad.shape[-2:] == (1, 1):  # a CNN's global pool, which PyTorch runs as a mean
                return grad.expand(shape) / (shape[-1] * shape[-2]), None, None, None
            like = torch.zeros((), dtype=dtype, device=device).expand(shape)  # its shape only
            return (torch.ops.aten._adaptive_avg_pool2d_backward(grad, like), None, None,
                    None)
        zeros = torch.zeros(shape, dtype=dtype, device=device, requires_grad=True)
        with torch.enable_grad(), plain_saving():
            out = func(zeros, *rest, **kwargs)
        (gx,) = torch.autograd.grad(out, zeros, grad)
        return gx, None, None, None

_DIMS = {F.max_pool2d: 2, F.max_pool3d: 3}  # 1-d keeps PyTorch's own (exact) indices


@register(tuple(_DIMS), "pooling", None, "argmax offset in its window (1 byte, exact)")
def max_pool(s, func, args, kwargs, level):
    x = args[0]
    dims = _DIMS[func]
    if (not level.masks or x.dim() < dims + 1
            or arg(args, kwargs, 6, "return_indices", False)):
        return None
    kernel = as_tuple(arg(args, kwargs, 1, "kernel_size", None), dims)
    stride = as_tuple(arg(args, kwargs, 2, "stride", None) or kernel, dims)
    padding = as_tuple(arg(args, kwargs, 3, "padding", 0), dims)
    dilation = as_tuple(arg(args, kwargs, 4, "dilation", 1), dims)
    ceil_mode = bool(arg(args, kwargs, 5, "ceil_mode", False))
    if math.prod(kernel) > 256:
        return None
    return OffsetMaxPool.apply(x, dims, kernel, stride, padding, dilation, ceil_mode, s)


#: ``F.grid_sample``'s modes and padding modes as its backward kernels number them.
_GRID_MODES = {"bilinear": 0, "nearest": 1, "bicubic": 2}
_GRID_PADDINGS = {"zeros": 0, "border": 1, "reflection": 2}


@register((F.grid_sample,), "pooling", None,
          "the grid exact (which values are read, and their weights, are nonlinear in it); "
          "the input at the level's sensitive bits where the grid's gradient reads it (linear "
          "in it), else nothing (the input's gradient reads the grid alone)")
def grid_sample(s, func, args, kwargs, level):
    """``F.grid_sample(x, grid)`` saves ``x`` and ``grid``. Its input gradient scatters the
    output gradient with weights computed from the grid alone; its grid gradient is linear in
    ``x`` (the differences of neighbouring values the interpolation reads), so a rounded copy
    keeps it unbiased. Differences of neighbours are small against a group's range, so the
    copy takes the level's sensitive width (docs/training.md). Where the grid records no
    gradient (a fixed warp) or the mode is ``nearest`` (no grid gradient), nothing of ``x``
    is kept. The grid stays exact (deformable attention's is a fraction of its values)."""
    x, grid = args[0], arg(args, kwargs, 1, "grid", None)
    mode = arg(args, kwargs, 2, "mode", "bilinear")
    padding = arg(args, kwargs, 3, "padding_mode", "zeros")
    align_corners = arg(args, kwargs, 4, "align_corners", None)
    if (level.exact or not compressible(x, level) or level.sensitive_width is None
            or not isinstance(grid, torch.Tensor) or x.dim() not in (4, 5)
            or mode not in _GRID_MODES or padding not in _GRID_PADDINGS
            or not isinstance(align_corners, bool | None)):
        return None
    s.label.exact_ids = {id(grid): "grid"}  # (saved by the function below: named, exact)
    return PackedGridSample.apply(x, grid, mode, padding, align_corners,
                                  level.sensitive_width, s)


class PackedGridSample(torch.autograd.Function):
    """``F.grid_sample`` keeping its grid exact and its input at ``bits``, or nothing of the
    input where no grid gradient reads it (see :func:`grid_sample`); its backward is
    PyTorch's kernel."""

    @staticmethod
    def forward(ctx, x, grid, mode, padding, align_corners, bits, session):
        reads_input = ctx.needs_input_grad[1] and mode != "nearest"
        ctx.x = (session.packer.pack_fixed(x, bits, "grid_sample input", replaces=(x,))
                 if reads_input else None)
        if not reads_input:
            session.accounting.count(x)  # (what PyTorch keeps; nothing kept here)
        ctx.save_for_backward(grid)  # (exact: the label names it)
        ctx.conf = (mode, padding, bool(align_corners), x.shape, reads_input)
        return F.grid_sample(x, grid, mode, padding, align_corners)

    @staticmethod
    def backward(ctx, grad):
        check_double_backward()
        (grid,) = ctx.saved_tensors
        mode, padding, align_corners, shape, reads_input = ctx.conf
        dtype = grad.dtype  # (the op's own: autocast may have run it wider than its inputs)
        if reads_input:
            x = take(ctx, "x").get().to(dtype)
        else:  # the shape alone: the input's gradient reads no value of it
            x = torch.zeros((), dtype=dtype, device=grad.device).expand(shape)
        kernel = (torch.ops.aten.grid_sampler_2d_backward if len(shape) == 4
                  else torch.ops.aten.grid_sampler_3d_backward)
        gx, ggrid = kernel(grad, x, grid.to(dtype), _GRID_MODES[mode], _GRID_PADDINGS[padding],
                           align_corners, [ctx.needs_input_grad[0], ctx.needs_input_grad[1]])
        return gx, ggrid, None, None, None, None, None
