"""Masks: ReLU, ReLU6, hardtanh, leaky ReLU, clamp with constant bounds, dropout.

Their backward needs only where the slope is 1 (or the dropout mask): a 1-bit mask, exact. At
a level with 2 bits or more, ReLU instead packs its output once with code 0 kept for exact
zeros: that one copy serves the next layer's saved input and this backward's mask. A small
ReLU (under ``LEAN_NUMEL`` elements) without an allocator runs as PyTorch's own, its saved
output packed so by the hooks (rule bits ``"zeros"``): no autograd function around it, whose
Python costs more than the memory it saves there (a gradient-sized tensor in backward).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812

from actune import substitutes
from actune.rules import register
from actune.substitutes import (
    MaskedDropout,
    MaskedLinear,
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
        if x.numel() < substitutes.LEAN_NUMEL and s.allocator() is None:
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
