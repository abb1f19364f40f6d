"""Activations: GELU, SiLU, sigmoid, tanh (derivative saved), GLU (its halves' derivatives),
softmax and softmin (two rounded copies), log-softmax (its probabilities saved). The other
smooth activations keep their derivative through :mod:`actune.rules.pointwise`.

A nonlinearity's backward would read its input or output through the nonlinearity, which turns
rounding noise into bias. These save their derivative instead, rounded at ``other_bits`` and
used linearly (``grad * f'(x)``): unbiased (Few-Bit Backward, Novikov et al., ICML 2023, keeps
such derivatives in 2-3 bits). Softmax's backward ``y * (g - sum(g * y))`` is quadratic in its
output: two independently rounded copies, one per factor, keep it unbiased. Log-softmax's
backward ``g - p * sum(g)`` is linear in the probabilities ``p``: one rounded copy.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F  # noqa: N812

from actune.packing.codebooks import gelu_codebook
from actune.packing.saved import row_statistic
from actune.rules.registry import register
from actune.substitutes.functions import (
    CodedDerivative,
    DerivativeGLU,
    PackedLogSoftmax,
    PackedLogSumExp,
    SavedDerivative,
    SavedInput,
    TwoCopySoftmax,
    arg,
    gelu_derivative,
    gelu_function,
    silu_derivative,
)


def compressible(x, level) -> bool:
    """Is ``x`` a floating tensor large enough to pack at ``level.other_bits``, and not a
    per-row statistic (:func:`~actune.packing.saved.row_statistic`, kept exact)?"""
    return (level.other_bits is not None and isinstance(x, torch.Tensor)
            and x.is_floating_point() and x.numel() >= level.min_numel
            and not row_statistic(x))


_DERIVATIVE = "derivative rounded at other bits (used linearly)"


@register((F.gelu,), "activation", None, "its input at the level's gelu_input_bits, from "
          "which the matmul reading its output rebuilds it; or " + _DERIVATIVE + "; or the "
          "index of its nearest level on a fixed codebook (the level's derivative_codes)")
def gelu(s, func, args, kwargs, level):
    x = args[0]
    if not compressible(x, level):
        return None
    approximate = arg(args, kwargs, 1, "approximate", "none")
    if level.gelu_input_bits is not None:
        held: list = []
        out = SavedInput.apply(x, gelu_function(approximate), level.gelu_input_bits, s, held)
        copy, rebuild = held[0]  # (the matmul reading the output rebuilds it from the copy)
        s.derive(out, copy, None, None, function=rebuild)
        return out
    fn = functools.partial(F.gelu, approximate=approximate)
    if level.derivative_codes is not None:
        return CodedDerivative.apply(x, fn, gelu_derivative(approximate),
                                     gelu_codebook(approximate, level.derivative_codes), s)
    return SavedDerivative.apply(x, fn, gelu_derivative(approximate), level.other_bits, s, True)


@register((F.silu,), "activation", None, _DERIVATIVE)
def silu(s, func, args, kwargs, level):
    x = args[0]
    if not compressible(x, level):
        return None
    if arg(args, kwargs, 1, "inplace", False):
        if x.is_leaf or x._base is not None:
            return None  # a leaf or a view written in place: PyTorch's own (its errors)
        return SavedDerivative.apply(x, lambda t: F.silu(t, inplace=True), silu_derivative,
                                     level.other_bits, s, True, True)
    return SavedDerivative.apply(x, F.silu, silu_derivative, level.other_bits, s, True)


@register((torch.sigmoid, F.sigmoid, torch.Tensor.sigmoid, torch.special.expit), "activation",
          None, _DERIVATIVE)
def sigmoid(s, func, args, kwargs, level):
    x = args[0]
    if not compressible(x, level):
        return None
    return SavedDerivative.apply(x, torch.sigmoid, lambda _x, y: y * (1 - y),
                                 level.other_bits, s, False)


@register((torch.tanh, F.tanh, torch.Tensor.tanh), "activation", None, _DERIVATIVE)
def tanh(s, func, args, kwargs, level):
    x = args[0]
    if not compressible(x, level):
        return None
    return SavedDerivative.apply(x, torch.tanh, lambda _x, y: 1 - y * y, level.other_bits, s,
                                 False)


@register((F.softmax, torch.softmax, torch.Tensor.softmax, torch.special.softmax), "activation",
          None, "two independently rounded copies of the output (backward quadratic in it)")
def softmax(s, func, args, kwargs, level):
    x = args[0]
    dim = arg(args, kwargs, 1, "dim", None)
    if not compressible(x, level) or dim is None:
        return None
    return TwoCopySoftmax.apply(x, dim, kwargs.get("dtype"), level.other_bits, s)


@register((F.softmin,), "activation", None,
          "two independently rounded copies of the output (softmax of -x)")
def softmin(s, func, args, kwargs, level):
    x = args[0]
    dim = arg(args, kwargs, 1, "dim", None)
    if not compressible(x, level) or dim is None:
        return None
    return TwoCopySoftmax.apply(-x, dim, arg(args, kwargs, 3, "dtype", None), level.other_bits,
                                s)


@register((F.glu,), "activation", None,
          "the two halves' derivatives rounded at other bits (backward linear in each)")
def glu(s, func, args, kwargs, level):
    x = args[0]
    if not compressible(x, level):
        return None
    return DerivativeGLU.apply(x, arg(args, kwargs, 1, "dim", -1), level.other_bits, s)


@register((torch.logsumexp, torch.Tensor.logsumexp, torch.special.logsumexp), "activation",
          None, "exp(x - result), a softmax, rounded at other bits (backward g * it, linear "
          "in it), not the input and the result")
def logsumexp(s, func, args, kwargs, level):
    """A contrastive loss's or a router's z-loss's ``logsumexp``: PyTorch keeps its input and
    result for ``g * exp(x - result)``; the rule keeps that softmax, rounded."""
    x, dim = args[0], arg(args, kwargs, 1, "dim", None)
    if not compressible(x, level) or dim is None or kwargs.get("out") is not None:
        return None
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    if not dims:
        return None  # (an empty dim list reduces everything: PyTorch's own)
    return PackedLogSumExp.apply(x, dims, bool(arg(args, kwargs, 2, "keepdim", False)),
                                 level.other_bits, s)


@register((F.log_softmax, torch.log_softmax, torch.Tensor.log_softmax,
           torch.special.log_softmax), "activation", None,
          "the probabilities rounded at other bits (backward linear in them)")
def log_softmax(s, func, args, kwargs, level):
    x = args[0]
    dim = arg(args, kwargs, 1, "dim", None)
    if not compressible(x, level) or dim is None:
        return None
    dtype = arg(args, kwargs, 3 if func is F.log_softmax else 2, "dtype", None)
    return PackedLogSoftmax.apply(x, dim, dtype, level.other_bits, s)
