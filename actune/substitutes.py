"""Autograd functions that stand in for ops whose saved tensors can be smaller.

Each keeps, for backward, something smaller than what PyTorch's own op saves, and still
exact or unbiased (see docs/training.md): ReLU's output packed with exact zeros, 1-bit masks,
max pooling's argmax offsets, an activation's derivative instead of its input, softmax's two
independently rounded copies; and the ordered convolution backward, which needs one
activation-sized tensor at a time. The function mode in :mod:`actune.hooks` decides which op
runs through which function.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F  # noqa: N812
from torch._subclasses.fake_tensor import FakeTensor

from actune.random_masks import drawn_here, keep_mask
from actune.saved import Saved, check_double_backward, take

__all__ = ["LEAN_NUMEL", "LeanBatchNorm", "MaskedDropout", "MaskedLinear", "OffsetMaxPool",
           "OrderedConv", "PackedLogSoftmax", "PackedReLU", "SavedDerivative", "TwoCopySoftmax",
           "arg", "as_tuple",
           "conv_args", "gelu_derivative", "indices_from_offsets", "inside",
           "positive_after", "positive_before", "silu_derivative", "window_offsets"]


class MaskedLinear(torch.autograd.Function):
    """y = f(x) whose derivative is piecewise constant: saves a 1-bit mask.

    ``mask_of(x, y)`` gives where the slope is 1; elsewhere it is ``low`` (0 for ReLU and
    hardtanh, the negative slope for leaky ReLU), so the gradient is exactly PyTorch's.
    """

    @staticmethod
    def forward(ctx, x, fn, mask_of, low, inplace, session):
        mask = mask_of(x, None) if inplace else None
        y = fn(x)
        if mask is None:
            mask = mask_of(x, y)
        ctx.mask = session.pack_bool(mask, "mask", replaces=(y if low == 0.0 else x,))
        ctx.low = low
        if inplace:
            ctx.mark_dirty(x)
        return y

    @staticmethod
    def backward(ctx, grad):
        check_double_backward()
        mask = take(ctx, "mask").get()
        if ctx.low == 0.0:
            out = grad.masked_fill(~mask, 0.0)
        else:
            out = torch.where(mask, grad, grad * ctx.low)
        return out, None, None, None, None, None


class OrderedConv(torch.autograd.Function):
    """A convolution whose backward needs one activation-sized tensor at a time.

    PyTorch's convolution backward holds the dequantized input and the input gradient
    together. This one computes the weight (and bias) gradient first, frees the dequantized
    input, and then computes the input gradient as the transposed convolution of the output
    gradient (the same kernel, the same values), which needs no input at all. Its saved input
    goes through the saved-tensor hooks like any other (packed once, shared with the ReLU or
    the other convolution that saved the same storage, offloaded at L4/L5)."""

    @staticmethod
    def forward(ctx, x, weight, bias, stride, padding, dilation, groups):
        n = weight.dim() - 2
        stride, padding, dilation = as_tuple(stride, n), as_tuple(padding, n), as_tuple(dilation, n)
        ctx.conf = (stride, padding, dilation, groups)
        ctx.bias_sizes = None if bias is None else list(bias.shape)
        ctx.save_for_backward(x, weight)
        y = torch.ops.aten.convolution(x, weight, bias, stride, padding, dilation, False,
                                       [0] * n, groups)
        # the rows and columns of the input the strided windows never reach
        ctx.output_padding = [
            size - ((out - 1) * st + dil * (k - 1) + 1 - 2 * pad)
            for size, out, k, st, pad, dil in zip(x.shape[2:], y.shape[2:], weight.shape[2:],
                                                  stride, padding, dilation, strict=True)]
        return y

    @staticmethod
    def backward(ctx, grad):
        check_double_backward()
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        stride, padding, dilation, groups = ctx.conf
        n = len(stride)
        x, weight = ctx.saved_tensors
        gw = gb = gx = None
        if need_w or need_b:
            _, gw, gb = torch.ops.aten.convolution_backward(
                grad, x, weight, ctx.bias_sizes, stride, padding, dilation, False, [0] * n,
                groups, [False, need_w, need_b])
        del x  # the dequantized input is freed before the input gradient is allocated
        if need_x:
            gx = torch.ops.aten.convolution(grad, weight, None, stride, padding, dilation, True,
                                            ctx.output_padding, groups)
        return gx, gw, gb, None, None, None, None


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


#: Convolutions whose input has fewer elements run PyTorch's own backward (and smaller batch
#: norms their own): the memory the ordered backward saves is small there, and its Python
#: overhead (about 0.1 ms a call on the CPU) is not.
LEAN_NUMEL = 1 << 20


def conv_args(func, args, kwargs):
    """(x, weight, bias, stride, padding, dilation, groups) of a plain convolution call that
    :class:`OrderedConv` should run, or None (small or unbatched input, string padding: PyTorch's
    own)."""
    x = args[0]
    if x.numel() < LEAN_NUMEL:
        return None
    weight, padding = arg(args, kwargs, 1, "weight", None), arg(args, kwargs, 4, "padding", 0)
    if (not isinstance(weight, torch.Tensor)
        or isinstance(padding, str) or x.dim() != weight.dim()):
        return None
    tensors = (x, weight, arg(args, kwargs, 2, "bias", None))
    device = x.device.type
    if torch.is_autocast_enabled(device):  # cast as autocast casts a convolution's arguments
        dtype = torch.get_autocast_dtype(device)
        tensors = tuple(t.to(dtype) if isinstance(t, torch.Tensor) else t for t in tensors)
    return (*tensors, arg(args, kwargs, 3, "stride", 1), padding,
            arg(args, kwargs, 5, "dilation", 1), arg(args, kwargs, 6, "groups", 1))


class PackedReLU(torch.autograd.Function):
    """ReLU whose output is packed once, with code 0 reserved for exact zeros: the same packed
    copy serves the next layer (a convolution's saved input) and this backward's mask, which
    is exact (``dequantize(y) > 0`` is ``y > 0``). No separate mask is stored."""

    @staticmethod
    def forward(ctx, x, inplace, bits, session):
        y = torch.relu_(x) if inplace else torch.relu(x)
        ctx.y = session.pack_value(y, bits, "relu", replaces=(y,), share_as=y, zero_code=True,
                                   dirty=inplace, reads=False)
        if inplace:
            ctx.mark_dirty(x)
        return y

    @staticmethod
    def backward(ctx, grad):
        check_double_backward()
        # PyTorch's own ReLU backward on the dequantized output (whose zeros are exact)
        y = take(ctx, "y").fresh()
        if y.dtype == torch.bool:  # the allocator kept only the mask
            return grad * y, None, None, None
        if isinstance(y, FakeTensor) and not torch.compiler.is_compiling():
            return y, None, None, None  # an estimate: the same storage, without the op
        # written over the dequantized copy, which nothing else reads
        return (torch.ops.aten.threshold_backward.grad_input(grad, y, 0.0, grad_input=y),
                None, None, None)


class MaskedDropout(torch.autograd.Function):
    """Dropout with PyTorch's scale (mask / (1 - p)). On the CPU its mask is drawn from a seed
    and drawn again in backward (nothing kept: :mod:`actune.random_masks`); elsewhere it is
    kept at 1 bit."""

    @staticmethod
    def forward(ctx, x, p, inplace, session):
        ctx.scale = 1 - p
        if drawn_here(x):
            ctx.seed, ctx.shape = session.draw_seed(x), x.shape
            keep = keep_mask(x.shape, 1 - p, ctx.seed, x)
            noise = keep.to(x.dtype).div_(1 - p)
            session.drawn_again("mask", replaces=(noise,))
            ctx.mask = None
        else:
            keep = torch.empty_like(x, dtype=torch.bool).bernoulli_(1 - p)
            noise = keep.to(x.dtype).div_(1 - p)
            ctx.mask = session.pack_bool(keep, "mask", replaces=(noise,))
        if inplace:
            ctx.mark_dirty(x)
            return x.mul_(noise)
        return x * noise

    @staticmethod
    def backward(ctx, grad):
        check_double_backward()
        keep = (keep_mask(ctx.shape, ctx.scale, ctx.seed, grad) if ctx.mask is None
                else take(ctx, "mask").get())
        return grad * keep.to(grad.dtype).div_(ctx.scale), None, None, None


class SavedDerivative(torch.autograd.Function):
    """y = f(x) for elementwise f: saves f'(x), quantized, and returns grad * f'(x).

    A derivative of the input alone (GELU, SiLU) is computed (one pass where PyTorch has the
    op's backward kernel: no temporaries) and packed before ``y`` exists, so ``x``, ``y`` and
    ``f'(x)`` are never alive together. With ``inplace`` (an input derivative only) ``fn``
    writes its result over ``x``, as ``SiLU(inplace=True)`` does."""

    @staticmethod
    def forward(ctx, x, fn, derivative, bits, session, of_input, inplace=False):
        # (forward runs without gradient recording: the derivative is a plain tensor)
        y = None if of_input else fn(x)
        d = derivative(x, y)
        ctx.d = session.pack_value(d, bits, "derivative", replaces=(x,))
        del d  # packed: freed before the output of an input-only derivative exists
        if inplace:
            ctx.mark_dirty(x)
        return fn(x) if y is None else y

    @staticmethod
    def backward(ctx, grad):
        check_double_backward()
        d = take(ctx, "d").fresh()
        out = d.mul_(grad) if d.dtype == grad.dtype else grad * d  # in place: one tensor less
        return out, None, None, None, None, None, None


class TwoCopySoftmax(torch.autograd.Function):
    """Softmax saving two independently rounded copies of its output: the backward
    ``y1 * (g - sum(g * y2))`` is then unbiased although it is quadratic in y."""

    @staticmethod
    def forward(ctx, x, dim, dtype, bits, session):
        y = torch.softmax(x, dim, dtype=dtype)
        ctx.y1 = session.pack_value(y, bits, "softmax", replaces=(y,), share_as=y)
        ctx.y2 = session.pack_value(y, bits, "softmax")
        ctx.dim = dim
        ctx.in_dtype = x.dtype
        return y

    @staticmethod
    def backward(ctx, grad):
        check_double_backward()
        y1, y2 = take(ctx, "y1"), take(ctx, "y2").get()
        inner = (grad * y2).sum(ctx.dim, keepdim=True)
        del y2
        out = y1.get() * (grad - inner)
        return out.to(ctx.in_dtype), None, None, None, None


class PackedLogSoftmax(torch.autograd.Function):
    """Log-softmax saving its probabilities ``p = exp(y)`` rounded: the backward
    ``g - p * sum(g)`` is linear in ``p``, so it stays unbiased."""

    @staticmethod
    def forward(ctx, x, dim, dtype, bits, session):
        y = torch.log_softmax(x, dim, dtype=dtype)
        p = y.exp()
        ctx.p = session.pack_value(p, bits, "softmax", replaces=(y,))
        del p
        ctx.dim, ctx.in_dtype = dim, x.dtype
        return y

    @staticmethod
    def backward(ctx, grad):
        check_double_backward()
        p = take(ctx, "p").fresh()
        out = grad - p.mul_(grad.sum(ctx.dim, keepdim=True))
        return out.to(ctx.in_dtype), None, None, None, None


class OffsetMaxPool(torch.autograd.Function):
    """Max pooling that keeps each output's argmax as an offset inside its window (uint8)
    instead of int64 input indices; backward is PyTorch's own with the indices rebuilt."""

    @staticmethod
    def forward(ctx, x, dims, kernel, stride, padding, dilation, ceil_mode, session):
        pool = F.max_pool2d if dims == 2 else F.max_pool3d
        y, idx = pool(x, kernel, stride, padding, dilation, ceil_mode, return_indices=True)
        offsets, ctx.spatial = window_offsets(idx, x.shape[-dims:], kernel, stride, padding,
                                              dilation)
        ctx.offsets = session.pack_small_ints(offsets, "maxpool", replaces=(x, idx))
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


def as_tuple(v, n: int) -> tuple:
    """A size argument as a tuple of ``n`` (an int stands for all dimensions)."""
    return tuple(v) if isinstance(v, (tuple, list)) else (v,) * n


def _unit(x: torch.Tensor) -> torch.Tensor:
    """A gradient of ones shaped like ``x``, as one broadcast scalar (no memory)."""
    return torch.ones((), dtype=x.dtype, device=x.device).expand_as(x)


def gelu_derivative(approximate: str):
    """GELU's derivative: PyTorch's own GELU backward with a unit gradient, one vectorised
    pass and no temporaries (1,024 x 680 values on the CPU: 0.64 against 1.79 ms for the tanh form
    spelled in tensor ops, docs/benchmarks.md)."""

    def derivative(x, _y):
        return torch.ops.aten.gelu_backward(_unit(x), x, approximate=approximate)

    return derivative


def silu_derivative(x, _y):
    """SiLU's derivative ``s (1 + x (1 - s))``, ``s = sigmoid(x)``: PyTorch's own SiLU
    backward with a unit gradient, one vectorised pass and no temporaries."""
    return torch.ops.aten.silu_backward(_unit(x), x)


def arg(args: tuple, kwargs: dict, i: int, name: str, default):
    """Argument ``i`` of a call, positional or by ``name`` (``default`` if absent)."""
    if len(args) > i:
        return args[i]
    return kwargs.get(name, default)


def positive_after(x, y):
    """ReLU's mask: where the output (or, before it exists, the input) is positive."""
    return (y if y is not None else x) > 0


def positive_before(x, y):
    """Leaky ReLU's mask: where the input was positive (the output has its sign)."""
    return (x if y is None else y) > 0


def inside(lo: float, hi: float):
    """Hardtanh's mask: where the input lies strictly between ``lo`` and ``hi``."""

    def mask(x, y):
        # for the out-of-place call x is the input; in place, it is read before clamping
        return (x > lo) & (x < hi)

    return mask
