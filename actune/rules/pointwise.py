"""Unary pointwise functions: the activations of ``torch.nn.functional`` without a rule of
their own, and any other pointwise function of one tensor, found by PyTorch's own op tags.

Each keeps its derivative ``f'(x)`` rounded at ``other_bits`` and used linearly
(``grad * f'(x)``: unbiased). The activations of ``torch.nn.functional`` compute it with
PyTorch's own backward kernel from the input alone (:data:`CLOSED_FORMS`), packed before
the output exists. Any other op gets the value and the derivative from one forward-mode pass
(:func:`actune.substitutes.functions.value_and_derivative`), so no op needs a formula written here:
an op a user calls on the way (``torch.atan``, ``torch.expm1``) is kept so, instead of its
exact input.

:func:`generic_rule` decides once per function whether it is such an op:

* its ATen op of the same name carries ``torch.Tag.pointwise`` and reads one tensor;
* a call on four values, with PyTorch's own saved-tensor bookkeeping, saves something (a
  negation, a copy or a rounding saves nothing, and keeps costing nothing).

What a pointwise op with two tensor operands saves (``atan2``, ``torch.where``, a division by
an activation) stays exact, as does an in-place call on a leaf or a view.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

import torch
import torch.nn.functional as F  # noqa: N812

from actune import tunables
from actune.rules.activations import compressible
from actune.rules.registry import Rule, register
from actune.substitutes.functions import (
    PointwiseDerivative,
    SavedDerivative,
    elu_derivative,
    hardswish_derivative,
    logsigmoid_derivative,
    mish_derivative,
    softplus_derivative,
    softsign_derivative,
    tanhshrink_derivative,
    value_and_derivative,
)

__all__ = ["CLOSED_FORMS", "GENERIC_KEEPS", "derivative_rule", "generic_rule"]

GENERIC_KEEPS = "derivative from forward-mode AD, rounded at other bits (used linearly)"


@functools.cache
def _inplace_position(func: Callable) -> int | None:
    """Where ``func`` takes ``inplace`` positionally (``F.elu(x, 1.0, True)``), or None."""
    try:
        names = list(inspect.signature(func).parameters)
    except (TypeError, ValueError):  # a builtin: no ``inplace`` argument to find
        return None
    return names.index("inplace") if "inplace" in names else None


_SELU_ALPHA, _SELU_SCALE = 1.6732632423543772848170429916717, 1.0507009873554804934193349852946

#: activation -> (its parameters' names and defaults after the input, a builder of its
#: derivative from them): PyTorch's own derivative kernels, computed from the input alone
#: before the output exists (so input, output and derivative are never alive together, and
#: an in-place call holds two tensors, not three)
CLOSED_FORMS: dict[Callable, tuple[tuple[tuple[str, object], ...], Callable]] = {
    F.hardswish: ((), lambda: hardswish_derivative),
    F.mish: ((), lambda: mish_derivative),
    F.elu: ((("alpha", 1.0),), lambda alpha: elu_derivative(alpha)),
    F.celu: ((("alpha", 1.0),), lambda alpha: elu_derivative(alpha, 1.0, 1 / alpha)),
    torch.celu: ((("alpha", 1.0),), lambda alpha: elu_derivative(alpha, 1.0, 1 / alpha)),
    F.selu: ((), lambda: elu_derivative(_SELU_ALPHA, _SELU_SCALE)),
    torch.selu: ((), lambda: elu_derivative(_SELU_ALPHA, _SELU_SCALE)),
    F.softplus: ((("beta", 1.0), ("threshold", 20.0)),
                 lambda beta, threshold: softplus_derivative(beta, threshold)),
    F.logsigmoid: ((), lambda: logsigmoid_derivative),
    F.softsign: ((), lambda: softsign_derivative),
    F.tanhshrink: ((), lambda: tanhshrink_derivative),
}


def _closed_form(func: Callable, args: tuple, kwargs: dict) -> Callable | None:
    entry = CLOSED_FORMS.get(func)
    if entry is None:
        return None
    names, build = entry
    values = [args[1 + i] if len(args) > 1 + i and not isinstance(args[1 + i], bool)
              else kwargs.get(name, default) for i, (name, default) in enumerate(names)]
    if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
        return None
    return build(*values)


def derivative_rule(s, func, args, kwargs, level):
    """Run a unary pointwise ``func`` keeping its derivative (see the module docstring);
    None where another tensor is an argument or nothing may be packed."""
    x = args[0]
    if not compressible(x, level) or not x.requires_grad:
        return None
    rest = args[1:]
    if any(isinstance(a, torch.Tensor) for a in (*rest, *kwargs.values())):
        return None  # a second operand (an out= tensor, a tensor bound): PyTorch's own
    at = _inplace_position(func)
    inplace = bool(kwargs.get("inplace", False) or (at is not None and len(args) > at
                                                    and args[at]))
    if inplace and (x.is_leaf or x._base is not None):
        return None  # a leaf or a view written in place: PyTorch's own (its errors)
    derivative = _closed_form(func, args, kwargs)
    if derivative is not None:
        return SavedDerivative.apply(x, lambda t: func(*(t, *args[1:]), **kwargs), derivative,
                                     level.other_bits, s, True, inplace)
    if inplace:
        if at is not None and len(args) > at:
            rest = (*args[1:at], False, *args[at + 1:])
        else:
            kwargs = {**kwargs, "inplace": False}
    with torch.no_grad():
        y, d = value_and_derivative(lambda t: func(t, *rest, **kwargs), x.detach())
    if d is None:
        return None  # a step function: its gradient is zero, and PyTorch's op saves nothing
    out = PointwiseDerivative.apply(x, y, d, level.other_bits, s, inplace)
    del y, d
    return out


# the smooth activations of ``torch.nn.functional`` (and their ``torch`` spellings); the
# piecewise-linear ones keep masks (:mod:`actune.rules.masks`)
register(CLOSED_FORMS, "activation", None,
         "derivative rounded at other bits (used linearly), from PyTorch's own derivative "
         "kernel before the output exists")(derivative_rule)


_GENERIC: dict[Callable, Rule | None] = {}

_RULE = Rule("activation", None, derivative_rule, GENERIC_KEEPS)


def generic_rule(func: Callable) -> Rule | None:
    """The derivative rule if ``func`` is a unary pointwise op that saves something, else
    None; decided once per function (see the module docstring)."""
    try:
        return _GENERIC[func]
    except KeyError:
        pass
    except TypeError:  # unhashable
        return None
    rule = _RULE if _saves_through_pointwise_op(func) else None
    if len(_GENERIC) < tunables.GENERIC_RULE_CACHE:
        _GENERIC[func] = rule
    return rule


def _saves_through_pointwise_op(func: Callable) -> bool:
    name = getattr(func, "__name__", None)
    if not isinstance(name, str) or name.endswith("_"):
        return False  # (in-place methods: ``Tensor.exp_``; and dunders)
    packet = getattr(torch.ops.aten, name.removeprefix("special_"), None) or getattr(
        torch.ops.aten, name, None)
    op = getattr(packet, "default", None)
    if op is None or torch.Tag.pointwise not in op.tags:
        return False
    schema = op._schema
    tensors = [a for a in schema.arguments if isinstance(a.type, torch.TensorType)]
    if len(tensors) != 1 or len(schema.returns) != 1 or schema.arguments[0] is not tensors[0]:
        return False
    return _saves_something(func)


def _saves_something(func: Callable) -> bool:
    """Does ``func`` on four float values save a tensor for backward?"""
    saved = []
    x = torch.full((4,), 0.5, requires_grad=True)
    try:
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(
                lambda t: saved.append(1) or t, lambda t: t):
            y = func(x)
    except (RuntimeError, TypeError, ValueError):  # needs more arguments: decide per call
        return True
    return bool(saved) and isinstance(y, torch.Tensor) and y.requires_grad
