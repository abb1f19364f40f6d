"""Which function runs through which traced autograd function, and at which level's bits.

:func:`dispatch` is what :func:`actune.compressed`'s function mode (and :class:`TracedMode`)
does while Dynamo traces: one table lookup per call, then a handler that returns the op's
output, or ``None`` where it keeps PyTorch's own op (a small tensor, an exact width, an
operand it does not cover). Handlers read the level only: no session, no allocator.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F  # noqa: N812
from torch.overrides import TorchFunctionMode

from actune.levels import Level
from actune.traced.functions import (
    PackedDerivative,
    PackedLinear,
    PackedNorm,
    PackedProduct,
    TwoCopySoftmax,
)

__all__ = ["TRACED", "TracedMode", "dispatch"]

Handler = Callable[[Level, tuple, dict], torch.Tensor | None]
#: function -> handler (see the module docstring)
TRACED: dict[Callable, Handler] = {}


def _register(*funcs: Callable) -> Callable[[Handler], Handler]:
    def add(handler: Handler) -> Handler:
        for f in funcs:
            TRACED[f] = handler
        return handler
    return add


def _arg(args: tuple, kwargs: dict, i: int, name: str, default=None):
    return args[i] if len(args) > i else kwargs.get(name, default)


def _activation(t, level: Level) -> bool:
    """A floating tensor computed in the graph (not a leaf such as a weight), large enough."""
    return (isinstance(t, torch.Tensor) and t.is_floating_point() and not t.is_leaf
            and t.numel() >= level.min_numel)


@_register(F.linear)
def _linear(level, args, kwargs):
    x, w, b = args[0], _arg(args, kwargs, 1, "weight"), _arg(args, kwargs, 2, "bias")
    if level.matmul_bits is None or not _activation(x, level) or not isinstance(w, torch.Tensor):
        return None
    return PackedLinear.apply(x, w, b, level.matmul_bits, level.group_size)


@_register(torch.addmm, torch.Tensor.addmm)
def _addmm(level, args, kwargs):
    """``addmm(bias, x, w)`` with a weight ``w`` (Hugging Face's Conv1D): a linear layer."""
    if len(args) != 3 or kwargs:
        return None
    b, x, w = args
    if (level.matmul_bits is None or not _activation(x, level) or not isinstance(w, torch.Tensor)
            or not w.is_leaf or b.dim() != 1):
        return None
    return PackedLinear.apply(x, w.t(), b, level.matmul_bits, level.group_size)


@_register(torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm,
           torch.Tensor.bmm)
def _matmul(level, args, kwargs):
    if len(args) != 2 or kwargs:
        return None
    a, b = args
    if level.matmul_bits is None or not (isinstance(a, torch.Tensor)
                                         and isinstance(b, torch.Tensor)):
        return None
    if b.is_leaf and b.dim() == 2 and _activation(a, level):  # x @ weight
        return PackedLinear.apply(a, b.t(), None, level.matmul_bits, level.group_size)
    if (_activation(a, level) and _activation(b, level) and a.dim() == b.dim() >= 3
            and a.shape[:-2] == b.shape[:-2]):
        return PackedProduct.apply(a, b, level.matmul_bits, level.group_size)
    return None


def _derivative(name: str) -> Handler:
    def handler(level, args, kwargs):
        x = args[0]
        if level.other_bits is None or not _activation(x, level):
            return None
        if name == "gelu" and _arg(args, kwargs, 1, "approximate", "none") == "tanh":
            return PackedDerivative.apply(x, "gelu_tanh", level.other_bits, level.group_size)
        if name == "silu" and _arg(args, kwargs, 1, "inplace", False):
            return None
        return PackedDerivative.apply(x, name, level.other_bits, level.group_size)
    return handler


_register(F.gelu)(_derivative("gelu"))
_register(F.silu)(_derivative("silu"))


def _norm(rms: bool) -> Handler:
    def handler(level, args, kwargs):
        x = args[0]
        shape = _arg(args, kwargs, 1, "normalized_shape")
        weight = _arg(args, kwargs, 2, "weight")
        bias = None if rms else _arg(args, kwargs, 3, "bias")
        eps = _arg(args, kwargs, 3 if rms else 4, "eps", None if rms else 1e-5)
        if level.other_bits is None or not _activation(x, level) or shape is None:
            return None
        if eps is None:
            eps = torch.finfo(x.dtype).eps
        dims = 1 if isinstance(shape, int) else len(shape)
        return PackedNorm.apply(x, weight, bias, dims, float(eps), rms, level.other_bits,
                                level.group_size)
    return handler


_register(F.layer_norm)(_norm(False))
_register(F.rms_norm)(_norm(True))


@_register(F.softmax, torch.softmax, torch.Tensor.softmax)
def _softmax(level, args, kwargs):
    x = args[0]
    dim = _arg(args, kwargs, 1, "dim")
    if (level.other_bits is None or not _activation(x, level) or dim is None
            or _arg(args, kwargs, 3 if len(args) > 3 else 2, "dtype") is not None):
        return None
    return TwoCopySoftmax.apply(x, dim, level.other_bits, level.group_size)


def dispatch(level: Level, func: Callable, args: tuple, kwargs: dict):
    """Run ``func`` through its traced rule at ``level``, or as it is."""
    handler = TRACED.get(func)
    if handler is not None and torch.is_grad_enabled():
        out = handler(level, args, kwargs)
        if out is not None:
            return out
    return func(*args, **kwargs)


class TracedMode(TorchFunctionMode):
    """Routes calls through :data:`TRACED` at ``level``: what a compressed model's forward runs
    under while Dynamo traces it (see :func:`actune.compress`)."""

    def __init__(self, level: Level) -> None:
        super().__init__()
        self.level = level

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return dispatch(self.level, func, args, kwargs or {})
