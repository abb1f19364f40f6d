"""Pooling and sampling: max pooling keeps each output's argmax as a one-byte offset in its
window (exact), not int64 input indices and not its input. Average pooling is linear and its
backward needs only the input's shape, yet PyTorch's keeps the whole input:
:class:`ShapeOnlyPool` keeps nothing. ``F.grid_sample`` (deformable attention's sampler, a
spatial transformer's) keeps its grid exact and its input rounded, or nothing of the input
where no grid gradient reads it (:mod:`actune.substitutes.grid_sample`)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F  # noqa: N812

from actune.packing.saved import check_double_backward, plain_saving
from actune.rules.activations import compressible
from actune.rules.registry import register
from actune.substitutes.functions import OffsetMaxPool, arg, as_tuple
from actune.substitutes.grid_sample import PackedGridSample, grid_sample_call

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



@register((F.grid_sample,), "pooling", None,
          "the grid exact (which values are read, and their weights, are nonlinear in it); "
          "the input at the level's sensitive bits where the grid's gradient reads it (linear "
          "in it), else nothing (the input's gradient reads the grid alone)")
def grid_sample(s, func, args, kwargs, level):
    """``F.grid_sample(x, grid)`` saves ``x`` and ``grid``: :class:`PackedGridSample` keeps
    the grid exact and ``x`` at the level's sensitive width, since the grid's gradient reads
    differences of neighbouring values, small beside a group's range (docs/training.md); or
    nothing of ``x`` where the grid records no gradient (a fixed warp) or the mode is
    ``nearest``."""
    call = grid_sample_call(args, kwargs)
    if (call is None or level.exact or level.sensitive_width is None
            or not compressible(call.x, level)):
        return None
    s.label.exact_ids = {id(call.grid): "grid"}  # (saved by the function: named, exact)
    return PackedGridSample.apply(*call, level.sensitive_width, s)
