"""Autograd functions that stand in for ops whose saved tensors can be smaller.

Each keeps, for backward, something smaller than what PyTorch's own op saves, and still
exact or unbiased (see docs/training.md): ReLU's output packed with exact zeros, 1-bit masks,
max pooling's argmax offsets (:mod:`actune.substitutes.max_pool_offsets`), an activation's
derivative
instead of its input, softmax's two independently rounded copies; and the ordered
convolution backward, which needs one activation-sized tensor at a time, as the lean batch
norm's (:mod:`actune.substitutes.lean_batch_norm`) needs two. The function mode in
:mod:`actune.session.hooks`
decides which op runs through which function.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F  # noqa: N812
from torch._subclasses.fake_tensor import FakeTensor
from torch.autograd import forward_ad

from actune import tunables
from actune.packing.random_masks import drawn_here, keep_mask
from actune.packing.saved import check_double_backward, take
from actune.packing.tensors import group_steps
from actune.substitutes.lean_batch_norm import LeanBatchNorm
from actune.substitutes.max_pool_offsets import OffsetMaxPool, indices_from_offsets, window_offsets

__all__ = [
    "DerivativeGLU",
    "LeanBatchNorm",
    "MaskedDropout",
    "MaskedLinear",
    "MaskedPReLU",
    "OffsetMaxPool",
    "OrderedConv",
    "PackedLogSoftmax",
    "PackedLogSumExp",
    "PackedReLU",
    "PointwiseDerivative",
    "SavedDerivative",
    "SavedInput",
    "SmoothFunction",
    "TwoCopySoftmax",
    "arg",
    "as_tuple",
    "autocast_dtype",
    "conv_args",
    "gelu_derivative",
    "gelu_function",
    "indices_from_offsets",
    "inside",
    "positive_after",
    "positive_before",
    "reduced_count",
    "silu_derivative",
    "value_and_derivative",
    "window_offsets",
]


class MaskedLinear(torch.autograd.Function):
    """y = f(x) whose derivative is piecewise constant: saves a 1-bit mask.

    ``mask_of(x, y)`` gives where the slope is ``high`` (1, or hardsigmoid's 1/6); elsewhere it
    is ``low`` (0 for ReLU and hardtanh, the negative slope for leaky ReLU), so the gradient is
    exactly PyTorch's.
    """

    @staticmethod
    def forward(ctx, x, fn, mask_of, low, inplace, session, high=1.0):
        mask = mask_of(x, None) if inplace else None
        y = fn(x)
        if mask is None:
            mask = mask_of(x, y)
        ctx.mask = session.packer.pack_bool(mask, "mask", replaces=(y if low == 0.0 else x,))
        ctx.low, ctx.high = low, high
        if inplace:
            ctx.mark_dirty(x)
        return y

    @staticmethod
    def backward(ctx, grad):
        check_double_backward()
        mask = take(ctx, "mask").get()
        inside = grad if ctx.high == 1.0 else grad * ctx.high
        if ctx.low == 0.0:
            out = inside.masked_fill(~mask, 0.0)
        else:
            out = torch.where(mask, inside, grad * ctx.low)
        return out, None, None, None, None, None, None


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


def conv_args(func, args, kwargs):
    """(x, weight, bias, stride, padding, dilation, groups) of a plain convolution call that
    :class:`OrderedConv` should run, or None (small or unbatched input, string padding: PyTorch's
    own)."""
    x = args[0]
    if x.numel() < tunables.LEAN_NUMEL:
        return None
    weight, padding = arg(args, kwargs, 1, "weight", None), arg(args, kwargs, 4, "padding", 0)
    if (not isinstance(weight, torch.Tensor)
        or isinstance(padding, str) or x.dim() != weight.dim()):
        return None
    tensors = (x, weight, arg(args, kwargs, 2, "bias", None))
    dtype = autocast_dtype(x.device.type)
    if dtype is not None:  # cast as autocast casts a convolution's arguments
        tensors = tuple(t.to(dtype) if isinstance(t, torch.Tensor) else t for t in tensors)
    return (*tensors, arg(args, kwargs, 3, "stride", 1), padding,
            arg(args, kwargs, 5, "dilation", 1), arg(args, kwargs, 6, "groups", 1))


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast casts to on ``device_type`` now, None where it is off or the device
    has no autocast (the meta device)."""
    try:
        return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(
            device_type) else None
    except RuntimeError:  # (no autocast for this device type)
        return None


class PackedReLU(torch.autograd.Function):
    """ReLU whose output is packed once, with code 0 reserved for exact zeros: the same packed
    copy serves the next layer (a convolution's saved input) and this backward's mask, which
    is exact (``dequantize(y) > 0`` is ``y > 0``). No separate mask is stored."""

    @staticmethod
    def forward(ctx, x, inplace, bits, session):
        y = torch.relu_(x) if inplace else torch.relu(x)
        ctx.y = session.packer.pack_value(y, bits, "relu", replaces=(y,), share_as=y,
                                          zero_code=True, dirty=inplace, reads=False)
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
    and drawn again in backward (nothing kept: :mod:`actune.packing.random_masks`); elsewhere it is
    kept at 1 bit."""

    @staticmethod
    def forward(ctx, x, p, inplace, session):
        ctx.scale = 1 - p
        if drawn_here(x):
            ctx.seed, ctx.shape = session.packer.draw_seed(x), x.shape
            keep = keep_mask(x.shape, 1 - p, ctx.seed, x)
            noise = keep.to(x.dtype).div_(1 - p)
            session.packer.drawn_again("mask", replaces=(noise,))
            ctx.mask = None
        else:
            keep = torch.empty_like(x, dtype=torch.bool).bernoulli_(1 - p)
            noise = keep.to(x.dtype).div_(1 - p)
            ctx.mask = session.packer.pack_bool(keep, "mask", replaces=(noise,))
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
        ctx.d = session.packer.pack_value(d, bits, "derivative", replaces=(x,))
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


class CodedDerivative(torch.autograd.Function):
    """y = f(x) for elementwise f: saves, for each element, which level of ``codebook``
    (:class:`actune.packing.codebooks.Codebook`) ``f'(x)`` is nearest to, at the codebook's bits,
    and
    returns ``grad`` times that level (Few-Bit Backward): deterministic, the forward exact.
    The derivative of the input alone is coded before ``y`` exists, as in
    :class:`SavedDerivative`."""

    @staticmethod
    def forward(ctx, x, fn, derivative, codebook, session):
        ctx.d = session.packer.pack_codes(codebook.pack(derivative(x, None)), "derivative",
                                          replaces=(x,))
        return fn(x)

    @staticmethod
    def backward(ctx, grad):
        check_double_backward()
        d = take(ctx, "d").fresh()
        out = d.mul_(grad) if d.dtype == grad.dtype else grad * d
        return out, None, None, None, None


class SavedInput(torch.autograd.Function):
    """y = f(x) for elementwise f, keeping ``x`` rounded at ``bits`` (wider than the level's
    average): backward returns ``grad * f'(x_hat)``, and the matmul that saves ``y`` (GELU's
    output, read by the next linear layer) rebuilds it as ``f(x_hat)`` from the same copy
    (``Derived``): one 4-bit copy serves both backwards where a 2-bit derivative and a 2-bit
    output take the same bytes with several times the noise (docs/training.md, "GELU at
    L3-L5"). ``f(x_hat)`` and ``f'(x_hat)`` are not linear in ``x_hat``: their rounding bias,
    ``Var / 2`` times the second and third derivatives, is taken off with ``Var`` from the
    group steps (``step**2 / 6``, its mean over where ``x`` falls between two codes). ``held``
    receives the copy and the function that rebuilds ``y`` from its value, for
    :meth:`actune.session.hooks.Session.derive`."""

    @staticmethod
    def forward(ctx, x, f: SmoothFunction, bits, session, held):
        found: list = []  # (from the packed copy on its device, before an offload)
        ctx.x = session.packer.pack_fixed(
            x, bits, "activation input", replaces=(x,), by_feature=True,
            observe=lambda p: found.append(_half_rounding_variance(p)))
        ctx.f = f
        ctx.half_var = half_var = found[0]
        held.append((ctx.x, lambda v: f.debiased_value(v, half_var)))
        return f.value(x)

    @staticmethod
    def backward(ctx, grad):
        check_double_backward()
        d = ctx.f.debiased_derivative(take(ctx, "x").get(), ctx.half_var)
        out = d.mul_(grad) if d.dtype == grad.dtype else grad * d
        return out, None, None, None, None


class SmoothFunction:
    """An elementwise function with its first three derivatives (for :class:`SavedInput`)."""

    def __init__(self, value, derivative, second, third) -> None:
        self.value, self.derivative, self.second, self.third = value, derivative, second, third

    def debiased_value(self, x: torch.Tensor, half_var: torch.Tensor | None) -> torch.Tensor:
        y = self.value(x)
        return y if half_var is None else y.sub_(self.second(x).mul_(half_var.to(y.dtype)))

    def debiased_derivative(self, x: torch.Tensor,
                            half_var: torch.Tensor | None) -> torch.Tensor:
        d = self.derivative(x, None)
        return d if half_var is None else d.sub_(self.third(x).mul_(half_var.to(d.dtype)))


def _half_rounding_variance(packed) -> torch.Tensor | None:
    """Half the mean variance stochastic rounding adds to an element of ``packed``: the mean
    of ``step**2 / 12`` over its groups (a device scalar; None where ``packed`` holds no
    steps, as an estimate's fake copy)."""
    meta = getattr(packed, "meta", None)
    if type(meta) is not torch.Tensor:
        return None
    return group_steps(packed).square().mean() / 12


def _normal_density(x: torch.Tensor) -> torch.Tensor:
    return torch.exp(x.square().mul_(-0.5)).mul_(0.3989422804014327)


@functools.cache
def gelu_function(approximate: str) -> SmoothFunction:
    """GELU with its derivatives. The second and third are the erf form's, ``phi(x) * (2 -
    x**2)`` and ``x * phi(x) * (x**2 - 4)``, for both forms: they only scale a bias
    correction, where the tanh form's differ by under 1e-3."""
    def second(x):
        return _normal_density(x).mul_(2 - x.square())

    def third(x):
        return _normal_density(x).mul_(x).mul_(x.square() - 4)

    return SmoothFunction(functools.partial(F.gelu, approximate=approximate),
                          gelu_derivative(approximate), second, third)


def value_and_derivative(fn, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``fn(x)`` and its elementwise derivative, in one forward-mode pass with a unit tangent.

    For a pointwise ``fn`` the tangent of the output is ``f'(x)`` itself, computed by the same
    kernel PyTorch's backward would use, and ``fn`` runs once: a random op (RReLU's slopes)
    keeps the draw its output was made with. The derivative is ``None`` where ``fn``'s output
    does not depend on ``x`` (a step function)."""
    with forward_ad.dual_level():
        out = fn(forward_ad.make_dual(x, _unit(x)))
        y, d = forward_ad.unpack_dual(out)
    return y, d


class PointwiseDerivative(torch.autograd.Function):
    """``y = f(x)`` for a unary pointwise ``f``, given its value ``y`` and derivative ``d``
    (:func:`value_and_derivative`, worked out before: forward-mode AD is off inside an
    autograd function's forward): saves ``d`` packed at ``bits`` and returns
    ``grad * d`` in backward (unbiased: linear in what is kept). ``inplace`` writes ``y``
    over ``x``, as ``Hardswish(inplace=True)`` does."""

    @staticmethod
    def forward(ctx, x, y, d, bits, session, inplace):
        ctx.d = session.packer.pack_value(d, bits, "derivative", replaces=(x,))
        if inplace:
            ctx.mark_dirty(x)
            return x.copy_(y)
        return y

    @staticmethod
    def backward(ctx, grad):
        check_double_backward()
        d = take(ctx, "d").fresh()
        out = d.mul_(grad) if d.dtype == grad.dtype else grad * d
        return out, None, None, None, None, None


class DerivativeGLU(torch.autograd.Function):
    """``glu(x) = a * sigmoid(b)`` (``a``, ``b`` the halves of ``x``) keeping ``sigmoid(b)``
    and ``a * sigmoid'(b)``, each rounded at ``bits``: the gradients ``grad * sigmoid(b)`` and
    ``grad * a * sigmoid'(b)`` are linear in them (unbiased), and together they are the size
    of ``x``, as PyTorch's saved input is."""

    @staticmethod
    def forward(ctx, x, dim, bits, session):
        a, b = x.chunk(2, dim)
        gate = torch.sigmoid(b)
        slope = a * gate * (1 - gate)
        ctx.gate = session.packer.pack_value(gate, bits, "derivative", replaces=(x,))
        ctx.slope = session.packer.pack_value(slope, bits, "derivative")
        ctx.dim = dim
        del slope
        return a * gate

    @staticmethod
    def backward(ctx, grad):
        check_double_backward()
        gate, slope = take(ctx, "gate").fresh(), take(ctx, "slope").fresh()
        return torch.cat((gate.mul_(grad), slope.mul_(grad)), ctx.dim), None, None, None


class MaskedPReLU(torch.autograd.Function):
    """``prelu(x, weight)`` keeping a 1-bit mask of where ``x > 0`` (the input gradient is
    ``grad`` there and ``weight * grad`` elsewhere, exactly) and ``min(x, 0)`` packed at
    ``bits`` for the weight's gradient ``sum(grad * min(x, 0))``, which is linear in it
    (unbiased). The weight is a parameter, held by reference."""

    @staticmethod
    def forward(ctx, x, weight, bits, session):
        positive = x > 0
        ctx.mask = session.packer.pack_bool(positive, "mask", replaces=(x,))
        ctx.negative = (session.packer.pack_value(x.clamp(max=0), bits, "other")
                        if weight.requires_grad else None)
        ctx.save_for_backward(weight)
        return torch.where(positive, x, x * _channels(weight, x))

    @staticmethod
    def backward(ctx, grad):
        check_double_backward()
        (weight,) = ctx.saved_tensors
        positive = take(ctx, "mask").get()
        w = _channels(weight, grad)
        gx = torch.where(positive, grad, grad * w) if ctx.needs_input_grad[0] else None
        gw = None
        if ctx.negative is not None and ctx.needs_input_grad[1]:
            product = take(ctx, "negative").fresh().mul_(grad)
            keep = (1,) if weight.numel() > 1 and grad.dim() >= 2 else ()
            dims = [d for d in range(grad.dim()) if d not in keep]
            gw = product.sum(dims).reshape(weight.shape).to(weight.dtype)
        return gx, gw, None, None


def _channels(weight: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """PReLU's weight broadcast over ``like`` (2 dims or more): one value, or one per channel
    (dim 1)."""
    if weight.numel() == 1:
        return weight.reshape(())
    return weight.reshape(-1, *(1,) * (like.dim() - 2))


class TwoCopySoftmax(torch.autograd.Function):
    """Softmax saving two independently rounded copies of its output: the backward
    ``y1 * (g - sum(g * y2))`` is then unbiased although it is quadratic in y. It is computed
    with ``g`` centred on its mean (:func:`softmax_shift`)."""

    @staticmethod
    def forward(ctx, x, dim, dtype, bits, session):
        y = torch.softmax(x, dim, dtype=dtype)
        ctx.y1 = session.packer.pack_value(y, bits, "softmax", replaces=(y,), share_as=y)
        ctx.y2 = session.packer.pack_value(y, bits, "softmax")
        ctx.dim = dim
        ctx.in_dtype = x.dtype
        return y

    @staticmethod
    def backward(ctx, grad):
        check_double_backward()
        y1, y2 = take(ctx, "y1"), take(ctx, "y2").get()
        shift = softmax_shift(grad, y2, ctx.dim)
        del y2
        out = y1.get() * (grad - shift)
        return out.to(ctx.in_dtype), None, None, None, None


def softmax_shift(grad: torch.Tensor, y2: torch.Tensor, dim: int) -> torch.Tensor:
    """What softmax's backward ``y1 * (grad - shift)`` subtracts: ``sum(grad * y2)`` for exact
    probabilities, here for ``grad`` centred on its mean ``m`` first: ``m + sum((grad - m) *
    y2)``. The two agree where ``y2`` sums to 1 (the output is invariant to a constant added
    to ``grad``); a rounded ``y2`` does not, and the plain form turns the gradient's common
    part ``m`` times its rounding error ``sum(y2) - 1`` into noise on every element: large
    where the gradient's rows are nearly constant (values that look alike, few keys), and
    where the true result is a small difference. Unbiased either way (``y2`` unbiased,
    ``m`` exact); one more reduction, no tensor of the input's size."""
    mean = grad.mean(dim, keepdim=True)
    return mean + (grad * y2).sum(dim, keepdim=True) - mean * y2.sum(dim, keepdim=True)


class PackedLogSoftmax(torch.autograd.Function):
    """Log-softmax saving its probabilities ``p = exp(y)`` rounded: the backward
    ``g - p * sum(g)`` is linear in ``p``, so it stays unbiased."""

    @staticmethod
    def forward(ctx, x, dim, dtype, bits, session):
        y = torch.log_softmax(x, dim, dtype=dtype)
        p = y.exp()
        ctx.p = session.packer.pack_value(p, bits, "softmax", replaces=(y,))
        del p
        ctx.dim, ctx.in_dtype = dim, x.dtype
        return y

    @staticmethod
    def backward(ctx, grad):
        check_double_backward()
        p = take(ctx, "p").fresh()
        out = grad - p.mul_(grad.sum(ctx.dim, keepdim=True))
        return out.to(ctx.in_dtype), None, None, None, None


class PackedLogSumExp(torch.autograd.Function):
    """``logsumexp`` saving ``p = exp(x - result)`` (a softmax) rounded, not its input and
    result: the backward ``g * p`` is linear in ``p``, so it stays unbiased."""

    @staticmethod
    def forward(ctx, x, dim, keepdim, bits, session):
        out = torch.logsumexp(x, dim, keepdim=True)
        p = (x - out).exp_()
        ctx.p = session.packer.pack_value(p, bits, "softmax", replaces=(x, out))
        del p
        ctx.dim, ctx.keepdim, ctx.in_dtype = dim, keepdim, x.dtype
        return out if keepdim else out.squeeze(dim)

    @staticmethod
    def backward(ctx, grad):
        check_double_backward()
        p = take(ctx, "p").fresh()
        if not ctx.keepdim:
            for d in sorted(d % p.dim() for d in ctx.dim):
                grad = grad.unsqueeze(d)
        return p.mul_(grad).to(ctx.in_dtype), None, None, None, None


def as_tuple(v, n: int) -> tuple:
    """A size argument as a tuple of ``n`` (an int stands for all dimensions)."""
    return tuple(v) if isinstance(v, (tuple, list)) else (v,) * n


def _unit(x: torch.Tensor) -> torch.Tensor:
    """A gradient of ones shaped like ``x``, as one broadcast scalar (no memory)."""
    return torch.ones((), dtype=x.dtype, device=x.device).expand_as(x)


#: (dtype, device) -> a scalar one that the backward kernels below read as their gradient.
_ONES: dict[tuple, torch.Tensor] = {}


def _read_unit(x: torch.Tensor) -> torch.Tensor:
    """:func:`_unit` for a kernel that only reads it (PyTorch's backward kernels): one scalar
    per dtype and device made once, not one op more per call (a plain tensor's; a fake one,
    an estimate's, gets its own)."""
    if type(x) is not torch.Tensor:
        return _unit(x)
    key = (x.dtype, x.device)
    one = _ONES.get(key)
    if one is None:
        one = _ONES[key] = torch.ones((), dtype=x.dtype, device=x.device)
    return one.expand_as(x)


# (the overloads themselves: an overload packet's call resolves one in Python every time)
_GELU_BACKWARD = torch.ops.aten.gelu_backward.default
_SILU_BACKWARD = torch.ops.aten.silu_backward.default
_HARDSWISH_BACKWARD = torch.ops.aten.hardswish_backward.default
_MISH_BACKWARD = torch.ops.aten.mish_backward.default
_ELU_BACKWARD = torch.ops.aten.elu_backward.default
_SOFTPLUS_BACKWARD = torch.ops.aten.softplus_backward.default


def gelu_derivative(approximate: str):
    """GELU's derivative: PyTorch's own GELU backward with a unit gradient, one vectorised
    pass and no temporaries, faster than the tanh form spelled in tensor ops
    (docs/benchmarks.md, "Step speed on the CPU")."""

    def derivative(x, _y):
        return _GELU_BACKWARD(_read_unit(x), x, approximate=approximate)

    return derivative


def silu_derivative(x, _y):
    """SiLU's derivative ``s (1 + x (1 - s))``, ``s = sigmoid(x)``: PyTorch's own SiLU
    backward with a unit gradient, one vectorised pass and no temporaries."""
    return _SILU_BACKWARD(_read_unit(x), x)


def hardswish_derivative(x, _y):
    """Hardswish's derivative: PyTorch's own backward kernel with a unit gradient."""
    return _HARDSWISH_BACKWARD(_read_unit(x), x)


def mish_derivative(x, _y):
    return _MISH_BACKWARD(_read_unit(x), x)


def elu_derivative(alpha: float, scale: float = 1.0, input_scale: float = 1.0):
    """ELU's (SELU's, CELU's) derivative of the input: PyTorch's ``elu_backward``."""
    def derivative(x, _y):
        return _ELU_BACKWARD(_read_unit(x), alpha, scale, input_scale, False, x)
    return derivative


def softplus_derivative(beta: float, threshold: float):
    def derivative(x, _y):
        return _SOFTPLUS_BACKWARD(_read_unit(x), x, beta, threshold)
    return derivative


def logsigmoid_derivative(x, _y):
    return torch.sigmoid(-x)


def softsign_derivative(x, _y):
    return x.abs().add_(1).square_().reciprocal_()


def tanhshrink_derivative(x, _y):
    return torch.tanh(x).square_()


def reduced_count(x: torch.Tensor, dim) -> int:
    """How many elements each result of a reduction of ``x`` over ``dim`` (None: all; an int;
    a sequence) reads. (A loop: Dynamo traces no generator handed to a builtin.)"""
    if dim is None:
        return x.numel()
    count = 1
    for d in (dim,) if isinstance(dim, int) else dim:
        count *= x.shape[d]
    return count


def arg(args: tuple, kwargs: dict, i: int, name: str, default):
    """Argument ``i`` of a call, positional or by ``name`` (``default`` if absent)."""
    if len(args) > i:
        return args[i]
    return kwargs.get(name, default)


def index_dtype(size: int) -> torch.dtype:
    """The narrowest integer type holding indices below ``size`` (uint8 up to 256, int16 up to
    32,768, else int32): what a rule keeps of int64 indices that ``size`` bounds."""
    return torch.uint8 if size <= 256 else torch.int16 if size <= 32768 else torch.int32


def one_class_per_row(x: torch.Tensor, target: torch.Tensor) -> bool:
    """Class indices for ``(N, C)`` logits, or for ``(N, C, d1, ...)`` ones at each of the
    ``(N, d1, ...)`` positions (the classes along dimension 1, as PyTorch's loss reads them)."""
    if x.dim() < 2 or target.dim() != x.dim() - 1:
        return False
    return x.dim() == 2 or target.shape == x.shape[:1] + x.shape[2:]


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
