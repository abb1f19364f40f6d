"""Max pooling that keeps each output's argmax as a one-byte offset inside its window
(:class:`OffsetMaxPool`), and the conversions between flat input indices and those offsets
(Numba kernels on the CPU for 2-d pooling, torch operations elsewhere)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F  # noqa: N812

from actune.packing.saved import check_double_backward, take

__all__ = ["OffsetMaxPool", "indices_from_offsets", "window_offsets"]


class OffsetMaxPool(torch.autograd.Function):
    """Max pooling that keeps each output's argmax as an offset inside its window (uint8)
    instead of int64 input indices; backward is PyTorch's own with the indices rebuilt."""

    @staticmethod
    def forward(ctx, x, dims, kernel, stride, padding, dilation, ceil_mode, session):
        pool = F.max_pool2d if dims == 2 else F.max_pool3d
        y, idx = pool(x, kernel, stride, padding, dilation, ceil_mode, return_indices=True)
        offsets, ctx.spatial = window_offsets(idx, x.shape[-dims:], kernel, stride, padding,
                                              dilation)
        ctx.offsets = session.packer.pack_small_ints(offsets, "maxpool", replaces=(x, idx))
        ctx.args = (dims, kernel, stride, padding, dilation, ceil_mode)
        ctx.in_shape, ctx.in_dtype = x.shape, x.dtype
        return y

    @staticmethod
    def backward(ctx, grad):
        check_double_backward()
        dims, kernel, stride, padding, dilation, ceil_mode = ctx.args
        offsets = take(ctx, "offsets").get()
        idx = indices_from_offsets(offsets, ctx.spatial, kernel, stride, padding, dilation)
        shape_only = torch.zeros((), dtype=ctx.in_dtype, device=grad.device).expand(ctx.in_shape)
        backward = (torch.ops.aten.max_pool2d_with_indices_backward if dims == 2
                    else torch.ops.aten.max_pool3d_with_indices_backward)
        out = backward(grad, shape_only, kernel, stride, padding, dilation, ceil_mode, idx)
        return out, None, None, None, None, None, None, None


def _window_grid(out_shape, kernel, stride, padding):
    grids = torch.meshgrid(*[torch.arange(n) * s - p
                             for n, s, p in zip(out_shape, stride, padding, strict=True)],
                           indexing="ij")
    return grids


def window_offsets(idx, in_spatial, kernel, stride, padding, dilation):
    """Flat input indices -> offset inside each window (row-major over the kernel)."""
    if _numba_pool(idx, kernel):
        from actune_kernels import pool

        planes = idx.numel() // math.prod(idx.shape[-2:])
        out = torch.empty((planes, math.prod(idx.shape[-2:])), dtype=torch.uint8)
        pool.offsets_2d(idx.reshape(planes, *idx.shape[-2:]).numpy(), out.numpy(),
                        in_spatial[-1], kernel, stride, padding, dilation)
        return out.view(idx.shape), tuple(in_spatial)
    # Elsewhere (GPU, fake tensors, 3-d): torch operations, in place on index-sized int32
    # buffers (at most three alive besides the indices, for 3-d pooling; two for 2-d).
    starts = [g.to(idx.device, torch.int32)
              for g in _window_grid(idx.shape[-len(kernel):], kernel, stride, padding)]
    rem = idx.to(torch.int32)  # plane indices fit; int32 halves the work
    offset = None
    scale = 1  # window positions per step of this dimension
    for d in reversed(range(len(kernel))):
        if d:
            coord = torch.remainder(rem, in_spatial[d])
            rem.div_(in_spatial[d], rounding_mode="floor")
        else:
            coord = rem  # what is left is the first coordinate
        coord.sub_(starts[d])
        if dilation[d] != 1:
            coord.div_(dilation[d], rounding_mode="floor")
        if scale != 1:
            coord.mul_(scale)
        offset = coord if offset is None else offset.add_(coord)
        del coord
        scale *= kernel[d]
    return offset.to(torch.uint8), tuple(in_spatial)


def _numba_pool(t: torch.Tensor, kernel) -> bool:
    """The CPU kernels handle real 2-d CPU tensors; everything else uses torch operations."""
    return len(kernel) == 2 and type(t) is torch.Tensor and t.device.type == "cpu"


def indices_from_offsets(offsets, in_spatial, kernel, stride, padding, dilation):
    if _numba_pool(offsets, kernel):
        from actune_kernels import pool

        out_h, out_w = offsets.shape[-2:]
        planes = offsets.numel() // (out_h * out_w)
        idx = torch.empty(offsets.shape, dtype=torch.int64)
        pool.indices_2d(offsets.reshape(planes, -1).contiguous().numpy(),
                        idx.view(planes, -1).numpy(), in_spatial[-1], out_h, out_w, kernel,
                        stride, padding, dilation)
        return idx
    # Elsewhere: torch operations, in place (one int32 buffer per pooled dimension).
    starts = [g.to(offsets.device, torch.int32)
              for g in _window_grid(offsets.shape[-len(kernel):], kernel, stride, padding)]
    rem = offsets.to(torch.int32)
    local = {}
    for d in range(len(kernel) - 1, 0, -1):
        local[d] = torch.remainder(rem, kernel[d])
        rem.div_(kernel[d], rounding_mode="floor")
    idx = rem  # the first dimension's position in its window
    for d in range(len(kernel)):
        loc = idx if d == 0 else local.pop(d)
        if dilation[d] != 1:
            loc.mul_(dilation[d])
        loc.add_(starts[d])  # the input coordinate
        if d:
            idx.mul_(in_spatial[d]).add_(loc)
        del loc
    return idx.long()
