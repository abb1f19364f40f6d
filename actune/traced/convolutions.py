"""Traced convolutions, ReLU and batch norm: what a ResNet saves, in compiled graphs.

A convolution keeps its input rounded at matmul bits (its weight gradient reads it linearly)
and the weight as a reference; ReLU keeps a 1-bit mask of where its output is positive (its
exact gradient); a training-mode batch norm keeps its input rounded at other bits and its
per-channel mean and ``rstd`` exact (the eager rules' choices, :mod:`actune.rules`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812

from actune import tunables
from actune.packing import graph_ops
from actune.traced.pack import in_memory_order, memory_order, pack, restore_order, unpack

__all__ = ["MaskedReLU", "PackedBatchNorm", "PackedConv", "graph_convolution", "pack_bits",
           "unpack_bits"]

# A convolution's forward as an op Inductor does not look into, on the CPU. Seeing an
# ``aten.convolution`` there, Inductor's layout optimization turns the whole graph
# channels-last and returns a channels-last copy of every convolution's weight as a tensor
# saved for backward, which raises the step's peak and slows it (docs/benchmarks.md,
# "torch.compile"). Behind this op the graph keeps
# the model's own layout, and a channels-last model stays channels-last.
_LIB = torch.library.Library("actune", "FRAGMENT")
_LIB.define("graph_convolution(Tensor x, Tensor w, Tensor? b, int[] stride, int[] padding, "
            "int[] dilation, int groups) -> Tensor")


def _convolution(x, w, b, stride, padding, dilation, groups):
    return torch.ops.aten.convolution(x, w, b, stride, padding, dilation, False,
                                      [0] * len(stride), groups)


_LIB.impl("graph_convolution", _convolution, "CPU")
torch.library.register_fake("actune::graph_convolution", _convolution, lib=_LIB)
#: ``graph_convolution(x, w, b, stride, padding, dilation, groups)``: PyTorch's convolution,
#: opaque to Inductor (used by :class:`PackedConv` on the CPU).
graph_convolution = torch.ops.actune.graph_convolution.default


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """A boolean tensor as one bit per element (uint8, eight neighbours a byte; zero-padded),
    in its memory order (:func:`~actune.traced.pack.memory_order`)."""
    flat = in_memory_order(mask, memory_order(mask)).reshape(-1).to(torch.uint8)
    pad = -flat.numel() % 8
    if pad:
        flat = F.pad(flat, (0, pad))
    q = flat.reshape(-1, 8)
    out = q[:, 0]
    for i in range(1, 8):
        out = out | (q[:, i] << i)
    return out


def unpack_bits(bits: torch.Tensor, shape: torch.Size,
                order: tuple[int, ...] | None = None) -> torch.Tensor:
    """The boolean tensor :func:`pack_bits` kept (``order``: the mask's memory order)."""
    # on the CPU an opaque op (a gather: Inductor's C++ kernels did not vectorise the shift
    # by each element's place in its byte where they fused it), elsewhere one broadcast
    # shift the readers fuse (a stack of eight shifted copies was eight buffers and a
    # concatenation a mask; eight slices of a byte each made channels-last readers slower)
    inner = shape if order is None else torch.Size(shape[d] for d in order)
    if bits.device.type == "cpu" and tunables.GRAPH_OPS_ON_CPU:
        q = graph_ops.graph_unpack_bits(bits, shape.numel())
    else:
        shifts = torch.arange(8, dtype=torch.uint8, device=bits.device)
        q = ((bits.unsqueeze(1) >> shifts) & 1).reshape(-1)[: shape.numel()].bool()
    return restore_order(q.reshape(inner), order)


class PackedConv(torch.autograd.Function):
    """A convolution keeping its input rounded (only if the weight needs a gradient)."""

    @staticmethod
    def forward(ctx, x, w, b, stride, padding, dilation, groups, bits: int, group_size: int):
        ctx.conf = (stride, padding, dilation, groups, None if b is None else [b.shape[0]])
        order = memory_order(x)  # (channels-last: packed as laid out, unpacked alike)
        ctx.meta = (x.shape, x.dtype, bits, group_size, order)
        keep = ctx.needs_input_grad[1]
        ctx.save_for_backward(w, *(pack(in_memory_order(x, order), bits, group_size) if keep
                                   else ()))
        if x.device.type == "cpu" and tunables.GRAPH_OPS_ON_CPU:
            return graph_convolution(x, w, b, stride, padding, dilation, groups)
        return torch.ops.aten.convolution(x, w, b, stride, padding, dilation, False,
                                          [0] * len(stride), groups)

    @staticmethod
    def backward(ctx, grad):
        w, *packed = ctx.saved_tensors
        shape, dtype, bits, group_size, order = ctx.meta
        stride, padding, dilation, groups, bias_sizes = ctx.conf
        need = ctx.needs_input_grad
        x = unpack(tuple(packed), bits, shape, dtype, group_size, order=order) if need[1] else \
            torch.empty(shape, dtype=dtype, device=grad.device)
        gx, gw, gb = torch.ops.aten.convolution_backward(
            grad, x, w, bias_sizes, stride, padding, dilation, False, [0] * len(stride), groups,
            [need[0], need[1], need[2]])
        return gx, gw, gb, None, None, None, None, None, None


class MaskedReLU(torch.autograd.Function):
    """ReLU keeping one bit per element: where its output is positive."""

    @staticmethod
    def forward(ctx, x):
        y = torch.relu(x)
        positive = y > 0
        ctx.layout = (x.shape, memory_order(positive))
        ctx.save_for_backward(pack_bits(positive))
        return y

    @staticmethod
    def backward(ctx, grad):
        return grad * unpack_bits(ctx.saved_tensors[0], *ctx.layout).to(grad.dtype)


class PackedBatchNorm(torch.autograd.Function):
    """Training-mode batch norm over dims 0, 2, 3...: returns the output and the batch's mean
    and biased variance (for the running statistics, updated by the caller)."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps: float, bits: int, group_size: int):
        dims = (0, *range(2, x.dim()))
        view = (1, -1, *([1] * (x.dim() - 2)))
        xf = x.float()
        var, mean = torch.var_mean(xf, dims, correction=0)
        rstd = torch.rsqrt(var + eps)
        y = (xf - mean.reshape(view)) * rstd.reshape(view)
        if weight is not None:
            y = y * weight.float().reshape(view)
        if bias is not None:
            y = y + bias.float().reshape(view)
        # a [batch, features] input (after a linear layer) by feature, as eager packs it
        by_feature = x.dim() == 2 and x.is_contiguous()
        order = None if by_feature else memory_order(x)
        ctx.meta = (x.shape, x.dtype, bits, group_size, weight is not None, order, by_feature)
        ctx.eps = eps
        ctx.save_for_backward(mean, rstd, *(() if weight is None else (weight,)),
                              *(pack(x, bits, group_size, True) if by_feature else
                                pack(in_memory_order(x, order), bits, group_size)))
        ctx.mark_non_differentiable(mean, var)
        return y.to(x.dtype), mean, var

    @staticmethod
    def backward(ctx, grad, _gmean, _gvar):
        shape, dtype, bits, group_size, has_weight, order, by_feature = ctx.meta
        mean, rstd, *rest = ctx.saved_tensors
        weight = rest.pop(0) if has_weight else None
        x = (unpack(tuple(rest), bits, shape, torch.float32, group_size, True) if by_feature
             else unpack(tuple(rest), bits, shape, torch.float32, group_size, order=order))
        # PyTorch's own backward on the unpacked input (linear in it: unbiased), which
        # Inductor decomposes as it does an uncompressed batch norm's
        gx, gw, gb = torch.ops.aten.native_batch_norm_backward(
            grad.float(), x, None if weight is None else weight.float(), None, None, mean,
            rstd, True, ctx.eps, [True, has_weight and ctx.needs_input_grad[1],
                                  ctx.needs_input_grad[2]])
        gw = gw.to(weight.dtype) if gw is not None else None
        gb = gb.to(dtype) if gb is not None else None
        return gx.to(dtype), gw, gb, None, None, None
