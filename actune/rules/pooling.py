"""Pooling and sampling: max pooling keeps each output's argmax as a one-byte offset in its window
(exact), not int64 input indices and not its input; adaptive max pooling, whose windows vary,
its argmax's index in the input's plane, in the narrowest integers the plane needs. Average
pooling is linear and its backward needs only the input's shape, yet PyTorch's keeps the whole
input: :class:`ShapeOnlyPool` keeps nothing. ``F.grid_sample`` (deformable attention's sampler,
a spatial transformer's) keeps its grid exact and its input rounded, or nothing of the input
where no grid gradient reads it (:mod:`actune.substitutes.grid_sample`)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F  # noqa: N812

from actune.packing.saved import check_double_backward, plain_saving, take
from actune.rules.activations import compressible
from actune.rules.registry import register
from actune.substitutes.functions import OffsetMaxPool, arg, as_tuple, index_dtype
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



_ADAPTIVE_MAX_DIMS = {F.adaptive_max_pool1d: 1, F.adaptive_max_pool2d: 2,
                      F.adaptive_max_pool3d: 3}


@register(tuple(_ADAPTIVE_MAX_DIMS), "pooling", None,
          "each argmax's index in its plane, in the narrowest integer type the plane needs "
          "(exact); nothing of the input")
def adaptive_max_pool(s, func, args, kwargs, level):
    """Adaptive max pooling keeps its input and int64 indices for a backward that reads only
    the indices (each output's argmax in its input plane). Kept: those indices in uint8 up
    to 256 positions a plane, int16 up to 32,768, else int32."""
    x = args[0]
    dims = _ADAPTIVE_MAX_DIMS[func]
    output_size = arg(args, kwargs, 1, "output_size", None)
    if (arg(args, kwargs, 2, "return_indices", False) or not isinstance(x, torch.Tensor)
            or x.dim() not in (dims + 1, dims + 2) or not x.is_floating_point()
            or x.numel() < level.min_numel or output_size is None):
        return None
    return CompactAdaptiveMaxPool.apply(x, func, output_size, dims, s)


class CompactAdaptiveMaxPool(torch.autograd.Function):
    """Adaptive max pooling keeping its argmax indices in the narrowest integer type (see
    :func:`adaptive_max_pool`); backward scatters the gradient by them, as PyTorch's does."""

    @staticmethod
    def forward(ctx, x, func, output_size, dims, session):
        out, indices = func(x, output_size, return_indices=True)
        ctx.indices = session.packer.pack_small_ints(
            indices, "maxpool", replaces=(x, indices),
            dtype=index_dtype(math.prod(x.shape[-dims:])))
        ctx.conf = (x.shape, x.dtype, dims)
        return out

    @staticmethod
    def backward(ctx, grad):
        check_double_backward()
        shape, dtype, dims = ctx.conf
        indices = take(ctx, "indices").get().long()
        planes = shape[:-dims]
        out = torch.zeros((*planes, math.prod(shape[-dims:])), dtype=dtype, device=grad.device)
        out.scatter_add_(-1, indices.reshape(*planes, -1), grad.to(dtype).reshape(*planes, -1))
        return out.reshape(shape), None, None, None, None


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
