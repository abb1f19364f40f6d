"""Masks: ReLU, ReLU6, hardtanh, leaky ReLU, hardsigmoid, hardshrink, softshrink, threshold,
PReLU, clamp with constant bounds, dropout; the maximum and minimum of two tensors, and over
dimensions (``amax``, ``amin``, ``max(x)``, ``min(x)``).

Their backward needs only which of two slopes holds where (or the dropout mask): a 1-bit mask,
exact (the maximum of two tensors: where each loses and where they tie; a maximum over
dimensions, ``amax``: where the input equals it). PReLU's
weight gradient also reads its negative inputs, linearly: rounded. At
a level with 2 bits or more, ReLU instead packs its output once with code 0 kept for exact
zeros: that one copy serves the next layer's saved input and this backward's mask. A small
ReLU (under ``tunables.LEAN_NUMEL`` elements) without an allocator runs as PyTorch's own, its saved
output packed so by the hooks (rule bits ``"zeros"``): no autograd function around it, whose
Python costs more than the memory it saves there (a gradient-sized tensor in backward).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812

from actune import tunables
from actune.packing.saved import check_double_backward, take
from actune.rules.pointwise import derivative_rule
from actune.rules.registry import register
from actune.substitutes.functions import (
    MaskedDropout,
    MaskedLinear,
    MaskedPReLU,
    PackedReLU,
    arg,
    inside,
    positive_after,
    positive_before,
)

_RELU = (F.relu, torch.relu, torch.Tensor.relu)
_RELU_INPLACE = (F.relu_, torch.relu_, torch.Tensor.relu_)


@register((*_RELU, *_RELU_INPLACE), "mask", "zeros",
          "output packed once with exact zeros (shared with the next layer), or a 1-bit mask")
def relu(s, func, args, kwargs, level):
    x = args[0]
    if not level.masks or not isinstance(x, torch.Tensor):
        return None
    inplace = func in _RELU_INPLACE or (func is F.relu and bool(kwargs.get("inplace")))
    bits = level.matmul_bits or level.other_bits
    if bits is not None and bits >= 2 and x.is_floating_point():
        if x.numel() < tunables.LEAN_NUMEL and s.allocating is None:
            return None  # PyTorch's own ReLU; the hooks pack its output ("zeros")
        return PackedReLU.apply(x, inplace, bits, s)
    fn = torch.relu_ if inplace else torch.relu
    return MaskedLinear.apply(x, fn, positive_after, 0.0, inplace, s)


@register((F.relu6, F.hardtanh), "mask", None, "1-bit mask (slope 1 inside the bounds)")
def hardtanh(s, func, args, kwargs, level):
    x = args[0]
    if not level.masks:
        return None
    lo, hi = (0.0, 6.0) if func is F.relu6 else (
        arg(args, kwargs, 1, "min_val", -1.0), arg(args, kwargs, 2, "max_val", 1.0))
    inplace = bool(arg(args, kwargs, 3 if func is F.hardtanh else 1, "inplace", False))
    fn = (lambda t: t.clamp_(lo, hi)) if inplace else (lambda t: t.clamp(lo, hi))
    return MaskedLinear.apply(x, fn, inside(lo, hi), 0.0, inplace, s)


@register((F.leaky_relu,), "mask", None, "1-bit mask (slope 1 or the negative slope)")
def leaky_relu(s, func, args, kwargs, level):
    x = args[0]
    if not level.masks:
        return None
    slope = float(arg(args, kwargs, 1, "negative_slope", 0.01))
    inplace = bool(arg(args, kwargs, 2, "inplace", False))
    fn = (lambda t: F.leaky_relu_(t, slope)) if inplace else (lambda t: F.leaky_relu(t, slope))
    return MaskedLinear.apply(x, fn, positive_before, slope, inplace, s)


def _masked(x, fn, mask_of, inplace: bool, s, high: float = 1.0):
    """``fn`` keeping a 1-bit mask of where its slope is ``high`` (0 elsewhere)."""
    if inplace and (x.is_leaf or x._base is not None):
        return None  # a leaf or a view written in place: PyTorch's own (its errors)
    return MaskedLinear.apply(x, fn, mask_of, 0.0, inplace, s, high)


@register((F.hardsigmoid,), "mask", None, "1-bit mask (slope 1/6 strictly inside (-3, 3))")
def hardsigmoid(s, func, args, kwargs, level):
    x = args[0]
    if not level.masks or not x.is_floating_point():
        return None
    inplace = bool(arg(args, kwargs, 1, "inplace", False))
    return _masked(x, lambda t: F.hardsigmoid(t, inplace), inside(-3.0, 3.0), inplace, s,
                   1 / 6)


@register((F.hardshrink, torch.hardshrink, torch.Tensor.hardshrink, F.softshrink), "mask",
          None, "1-bit mask (slope 1 outside [-lambda, lambda])")
def shrink(s, func, args, kwargs, level):
    x = args[0]
    lambd = arg(args, kwargs, 1, "lambd", 0.5)
    if not level.masks or not x.is_floating_point() or not isinstance(lambd, int | float):
        return None
    return _masked(x, lambda t: func(t, lambd), lambda t, _y: (t < -lambd) | (t > lambd),
                   False, s)


@register((F.threshold, torch.threshold), "mask", None,
          "1-bit mask (slope 1 above the threshold)")
def threshold(s, func, args, kwargs, level):
    x = args[0]
    th, value = arg(args, kwargs, 1, "threshold", None), arg(args, kwargs, 2, "value", None)
    if (not level.masks or not x.is_floating_point()
            or not all(isinstance(v, int | float) for v in (th, value))):
        return None
    inplace = func is F.threshold and bool(arg(args, kwargs, 3, "inplace", False))
    fn = (lambda t: torch.threshold_(t, th, value)) if inplace else (
        lambda t: torch.threshold(t, th, value))
    return _masked(x, fn, lambda t, _y: t > th, inplace, s)


@register((F.prelu, torch.prelu), "mask", None,
          "1-bit mask (slope 1 or the weight) and the negative inputs rounded at other bits "
          "(the weight's gradient, linear in them)")
def prelu(s, func, args, kwargs, level):
    x, weight = args[0], arg(args, kwargs, 1, "weight", None)
    if (not level.masks or level.other_bits is None or not isinstance(weight, torch.Tensor)
            or not x.is_floating_point() or x.dim() < 2 or x.dtype != weight.dtype
            or weight.numel() not in (1, x.shape[1])):
        return None  # a 1-D input, autocast's mixed dtypes: PyTorch's own
    return MaskedPReLU.apply(x, weight, level.other_bits, s)


@register((F.rrelu, torch.rrelu), "mask", None,
          "evaluation: 1-bit mask (slope 1 or the mean slope); training: the derivative "
          "with the slopes as drawn, rounded at other bits")
def rrelu(s, func, args, kwargs, level):
    """RReLU draws a slope per negative input in training: its derivative is kept, from the
    one draw that made the output (:func:`~actune.rules.pointwise.derivative_rule`). In
    evaluation its slope is the mean of its bounds: a leaky ReLU's mask."""
    x = args[0]
    lower, upper = arg(args, kwargs, 1, "lower", 1 / 8), arg(args, kwargs, 2, "upper", 1 / 3)
    training = bool(arg(args, kwargs, 3, "training", False))
    if training:
        return derivative_rule(s, func, args, kwargs, level)
    if not level.masks or not x.is_floating_point():
        return None
    inplace = bool(arg(args, kwargs, 4, "inplace", False))
    if inplace and (x.is_leaf or x._base is not None):
        return None
    slope = (lower + upper) / 2
    fn = (lambda t: F.leaky_relu_(t, slope)) if inplace else (lambda t: F.leaky_relu(t, slope))
    return MaskedLinear.apply(x, fn, positive_before, slope, inplace, s)


_CLAMP = (torch.clamp, torch.clip, torch.Tensor.clamp, torch.Tensor.clip)


@register(_CLAMP, "mask", None, "1-bit mask (slope 1 between the bounds, inclusive)")
def clamp(s, func, args, kwargs, level):
    x = args[0]
    lo, hi = arg(args, kwargs, 1, "min", None), arg(args, kwargs, 2, "max", None)
    if (not level.masks or not x.is_floating_point()
            or not all(b is None or isinstance(b, int | float) for b in (lo, hi))):
        return None  # tensor bounds: PyTorch's own (exact)

    def mask(t, _y):  # PyTorch's clamp passes the gradient where lo <= x <= hi
        m = torch.ones_like(t, dtype=torch.bool)
        if lo is not None:
            m &= t >= lo
        if hi is not None:
            m &= t <= hi
        return m

    return MaskedLinear.apply(x, lambda t: torch.clamp(t, lo, hi), mask, 0.0, False, s)


@register((torch.clamp_min, torch.Tensor.clamp_min, torch.clamp_max, torch.Tensor.clamp_max),
          "mask", None, "1-bit mask (slope 1 on the bound's side, inclusive)")
def one_sided_clamp(s, func, args, kwargs, level):
    x, bound = args[0], arg(args, kwargs, 1, "min" if "min" in func.__name__ else "max", None)
    if not level.masks or not x.is_floating_point() or not isinstance(bound, int | float):
        return None
    below = "max" in func.__name__
    return MaskedLinear.apply(x, lambda t: func(t, bound),
                              (lambda t, _y: t <= bound) if below else (lambda t, _y: t >= bound),
                              0.0, False, s)


@register((F.dropout,), "mask", None, "1-bit mask")
def dropout(s, func, args, kwargs, level):
    x = args[0]
    if not level.masks:
        return None
    p = float(arg(args, kwargs, 1, "p", 0.5))
    training = bool(arg(args, kwargs, 2, "training", True))
    inplace = bool(arg(args, kwargs, 3, "inplace", False))
    if not training or p == 0.0:
        return x
    if 0.0 < p < 1.0:
        return MaskedDropout.apply(x, p, inplace, s)
    return None


@register((torch.maximum, torch.Tensor.maximum, torch.minimum, torch.Tensor.minimum), "mask",
          None, "three 1-bit masks: where each operand loses, and where they tie (PyTorch "
          "halves the gradient there; a NaN passes it to both)")
def select_of_two(s, func, args, kwargs, level):
    """``torch.maximum(a, b)`` keeps both operands for a backward that reads only which one
    was selected. Kept: where ``a`` loses, where ``b`` loses and where they are equal, 1 bit
    each (none of them: a NaN, whose gradient PyTorch passes to both)."""
    a, b = args[0], arg(args, kwargs, 1, "other", None)
    if (not level.masks or not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor)
            or not a.is_floating_point() or a.dtype != b.dtype or "out" in kwargs
            or max(a.numel(), b.numel()) < level.min_numel):
        return None
    return MaskedSelectionOfTwo.apply(a, b, func.__name__ == "maximum", s)


class MaskedSelectionOfTwo(torch.autograd.Function):
    """``maximum`` or ``minimum`` of two tensors keeping three 1-bit masks (see
    :func:`select_of_two`); its backward is PyTorch's formula on them."""

    @staticmethod
    def forward(ctx, a, b, maximum, session):
        below, above = a < b, a > b
        pack = session.packer.pack_bool
        ctx.a_loses = pack(below if maximum else above, "mask", (a, b))
        ctx.b_loses = pack(above if maximum else below, "mask")
        ctx.tie = pack(a == b, "mask")
        ctx.shapes = (a.shape, b.shape)
        return torch.maximum(a, b) if maximum else torch.minimum(a, b)

    @staticmethod
    def backward(ctx, grad):
        check_double_backward()
        shared = torch.where(take(ctx, "tie").get(), grad / 2, grad)
        a_loses, b_loses = take(ctx, "a_loses").get(), take(ctx, "b_loses").get()
        a_shape, b_shape = ctx.shapes
        ga = shared.masked_fill(a_loses, 0).sum_to_size(a_shape) if ctx.needs_input_grad[0] \
            else None
        gb = shared.masked_fill(b_loses, 0).sum_to_size(b_shape) if ctx.needs_input_grad[1] \
            else None
        return ga, gb, None, None


@register((torch.amax, torch.Tensor.amax, torch.amin, torch.Tensor.amin), "mask", None,
          "a 1-bit mask of where the input equals the result (backward shares the gradient "
          "among them)")
def extremum(s, func, args, kwargs, level):
    """``x.amax(dims)`` keeps its input and result for a backward that reads only where they
    are equal (the gradient shared among the ties). Kept: that mask, 1 bit an element. Also
    ``max(x)`` and ``min(x)`` over every element (:func:`actune.rules.elementwise.selection`),
    whose backward treats a NaN result as equal to the NaNs."""
    x = args[0]
    dim = arg(args, kwargs, 1, "dim", ())
    keepdim = arg(args, kwargs, 2, "keepdim", False)
    if isinstance(dim, int) and not isinstance(dim, bool):
        dim = (dim,)
    if (not level.masks or not isinstance(x, torch.Tensor) or not x.is_floating_point()
            or x.numel() < level.min_numel or not isinstance(dim, tuple | list)
            or not isinstance(keepdim, bool) or "out" in kwargs or x.dim() == 0):
        return None
    dims = tuple(d % x.dim() for d in dim) or tuple(range(x.dim()))
    return MaskedExtremum.apply(x, "amax" in func.__name__, dims, keepdim, False, s)


class MaskedExtremum(torch.autograd.Function):
    """A maximum or minimum over ``dims`` keeping a 1-bit mask of where the input equals it
    (and, ``nan_ties``, of the NaNs where it is NaN, as ``max(x)``'s backward reads them):
    backward ``mask * grad / count`` (the ties share the gradient), as PyTorch's."""

    @staticmethod
    def forward(ctx, x, maximum, dims, keepdim, nan_ties, session):
        out = (torch.amax if maximum else torch.amin)(x, dims, keepdim=keepdim)
        kept = out if keepdim else out.reshape([1 if d in dims else n
                                                for d, n in enumerate(x.shape)])
        mask = x == kept
        if nan_ties:
            mask |= x.isnan() & kept.isnan()
        ctx.mask = session.packer.pack_bool(mask, "mask", (x, out))
        ctx.conf = (dims, keepdim, x.dtype)
        return out

    @staticmethod
    def backward(ctx, grad):
        check_double_backward()
        dims, keepdim, dtype = ctx.conf
        mask = take(ctx, "mask").get()
        if not keepdim:
            for d in sorted(dims):
                grad = grad.unsqueeze(d)
        count = mask.sum(dims, keepdim=True)
        return (grad / count).to(dtype) * mask, None, None, None, None, None
