"""Batch norm in training mode with a leaner backward (:class:`LeanBatchNorm`): two
activation-sized tensors alive in backward, not three, and a forward that may write its result
over its input. The rule in :mod:`actune.rules.norms` decides when it runs."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor

from actune.packing.saved import Saved, check_double_backward, take

__all__ = ["LeanBatchNorm"]


class LeanBatchNorm(torch.autograd.Function):
    """Batch norm in training mode whose backward needs two activation-sized tensors, not
    three, and whose forward may write its result over its input.

    PyTorch's backward holds the output gradient, the dequantized input and the input
    gradient together. This one computes the per-channel sums first (in slices of the batch)
    and then writes the input gradient over the dequantized input, a fresh copy that nothing
    else reads. With ``overwrite`` (the input is a convolution's output that nothing else reads,
    see :func:`actune.inplace.allow_inplace_norms`) the forward packs its input and then
    writes its result over it, so input and output are never alive together. ``save`` packs
    the input (the hooks' own packing: bits, sharing, offload) and returns what backward
    reads; when that is the input itself (kept as it is), the input is not overwritten."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, momentum, eps, overwrite,
                save):
        count = x.numel() // x.shape[1]
        if isinstance(x, FakeTensor):  # an estimate: the same allocations, no arithmetic
            mean, invstd = _fake_moments(x)  # (running statistics change in place: no bytes)
            scale, shift = torch.empty_like(mean), torch.empty_like(mean)
        else:
            var, mean = _channel_moments(x)
            invstd = (var + eps).rsqrt()
            if running_mean is not None:
                running_mean.mul_(1 - momentum).add_(mean, alpha=momentum)
            if running_var is not None:
                running_var.mul_(1 - momentum).add_(var, alpha=momentum * count
                                                    / max(count - 1, 1))
            scale = invstd if weight is None else invstd * weight
            shift = -mean * scale if bias is None else bias - mean * scale
        ctx.x = save(x)
        ctx.stats = (mean, invstd, count)
        ctx.save_for_backward(weight)
        if overwrite and ctx.x is not x:
            ctx.mark_dirty(x)
            return x.mul_(_per_channel(scale, x)).add_(_per_channel(shift, x))
        return torch.addcmul(_per_channel(shift, x), x, _per_channel(scale, x))

    @staticmethod
    def backward(ctx, grad):
        check_double_backward()
        (weight,) = ctx.saved_tensors
        mean, invstd, count = ctx.stats
        saved = take(ctx, "x")
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        x = saved.fresh() if isinstance(saved, Saved) else saved.clone()
        if isinstance(x, FakeTensor):  # an estimate: the same allocations, no arithmetic
            return _fake_norm_backward(x, need_x, need_w, need_b)
        gw, gb = _channel_sums(grad, x, mean, invstd, weight)  # sum(grad * x_hat), sum(grad)
        # grad_x = k (grad - gb / M - x_hat gw / M), k = weight * invstd, as a*x + b + k*grad
        k = invstd if weight is None else invstd * weight
        a = -k * invstd * gw / count
        b = -a * mean - k * gb / count
        gx = None
        if need_x:
            gx = x.mul_(_per_channel(a, x)).add_(_per_channel(b, x)).addcmul_(
                grad, _per_channel(k, x))
        del x
        return gx, gw if need_w else None, gb if need_b else None, None, None, None, None, \
            None, None


def _per_channel(v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Per-channel values ``v`` shaped to broadcast over ``x`` (channels in dimension 1)."""
    return v.view([1, -1] + [1] * (x.dim() - 2))


def _channel_moments(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per channel (dimension 1) biased variance and mean: a first mean, then the sums and
    squares of the deviations from it in eighths of the batch, which correct it (an
    eighth-sized temporary; on the CPU over ten times faster than ``torch.var_mean`` across
    the batch and spatial dimensions, as accurate). On fake tensors (estimates) two eighths
    stand for all: the same temporaries alive, a quarter of the operations."""
    dims = [0, *range(2, x.dim())]
    count = x.numel() // x.shape[1]
    first = x.sum(dims) / count
    centre = _per_channel(first, x)
    shift = squares = 0
    for part in x.chunk(8)[:2] if isinstance(x, FakeTensor) else x.chunk(8):
        deviation = torch.sub(part, centre)
        shift = shift + deviation.sum(dims)
        squares = squares + deviation.square_().sum(dims)
    shift = shift / count
    return squares / count - shift.square(), first + shift


def _fake_moments(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What :func:`_channel_moments` allocates, on fake tensors: two deviations of an eighth
    of the batch alive at once (the loop's next one is made before the last is freed), then
    two per-channel results."""
    eighth = (-(-x.shape[0] // 8), *x.shape[1:])  # (the bytes are what count: any layout)
    deviations = [x.new_empty(eighth), x.new_empty(eighth)]
    del deviations
    return x.new_empty(x.shape[1]), x.new_empty(x.shape[1])


def _fake_norm_backward(x: torch.Tensor, need_x: bool, need_w: bool, need_b: bool) -> tuple:
    """:class:`LeanBatchNorm`'s backward on fake tensors: the per-channel sums with the
    eighth-sized temporary the estimate counts for them (see :func:`_channel_sums`), and the
    input gradient written over ``x``."""
    temporary = x.new_empty((-(-x.shape[0] // 8), *x.shape[1:]))
    del temporary
    gw, gb = x.new_empty(x.shape[1]), x.new_empty(x.shape[1])
    return (x if need_x else None, gw if need_w else None, gb if need_b else None,
            None, None, None, None, None, None)


def _channel_sums(grad: torch.Tensor, x: torch.Tensor, mean: torch.Tensor,
                  invstd: torch.Tensor, weight: torch.Tensor | None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per channel ``sum(grad * x_hat)`` and ``sum(grad)`` without an activation-sized
    temporary: PyTorch's batch norm backward asked for the parameter gradients alone (one
    fused pass) on real tensors; on fake ones (estimates), whose version of that op returns
    an input gradient anyway, the sums over two eighths of the batch, which hold the
    temporaries all eight would (the estimate errs by at most an eighth, upwards)."""
    if not isinstance(x, FakeTensor):
        _, gw, gb = torch.ops.aten.native_batch_norm_backward(
            grad, x, weight, None, None, mean, invstd, True, 0.0, [False, True, True])
        return gw, gb
    dims = [0, *range(2, x.dim())]
    centred = _per_channel(mean, x)  # shapes, and the temporary of one eighth the chunks hold
    dot = sum(torch.sub(part, centred).mul_(g).sum(dims)
              for g, part in zip(grad.chunk(8)[:2], x.chunk(8)[:2], strict=True))
    return dot * invstd, grad.sum(dims)
