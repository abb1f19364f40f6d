"""Logits not computed until something needs them: a plain ``F.cross_entropy(lm_head(h), y)``
with the loss in chunks, in a model nobody wrote for actune.

A language model of one's own (nanoGPT, minGPT, a research model) computes its logits with an
``nn.Linear`` head and hands them to ``F.cross_entropy``, often through a ``view`` that
flattens the tokens. Those logits are the largest tensor of its step. Where
:func:`actune.chunk_loss` marks such a head (:func:`mark_head`), it returns a
:class:`LazyLogits` in eager training: a tensor of the logits' shape and dtype that holds the
hidden states and the weight, no values. ``F.cross_entropy`` on it (the loss rule of
:mod:`actune.rules.losses` under a compressing level, the class's own ``__torch_function__``
at an exact one) computes :func:`actune.linear_cross_entropy` from them, so the logits are
never whole. Views of the token dims (``view``, ``reshape``, slices of them, a cast such as
``.float()``) stay lazy, replayed on the hidden states. Anything else (an ``argmax`` for
accuracy, a label-smoothed loss, ``logits.tolist()``) computes the logits then, whole, as
PyTorch would have, and gradients reach the head through :class:`LazyHead`'s backward.

Why a tensor subclass and not a rewrite of the model: the pattern is recognised where it runs,
whatever the code around it, and every other use stays correct. What it holds: the hidden
states (exact) while the lazy logits live, and the head's input packed for its backward like
any linear layer's (``matmul_bits``), used only where the logits were computed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn
from torch.utils._python_dispatch import return_and_correct_aliasing
from torch.utils._pytree import tree_map
from torch.utils.weak import WeakIdKeyDictionary

from actune.packing.saved import check_double_backward

__all__ = ["LazyHead", "LazyLogits", "cross_entropy_in_chunks",
           "is_head", "lazy_head_forward", "mark_head", "provide", "unmark_head"]


#: What this module calls from the modules above it, given by them as they load
#: (:func:`provide`): importing them here would close a loop, as the session's module imports
#: the rules, which import this one. ``active_level`` (:mod:`actune.session.hooks`) and
#: ``linear_cross_entropy`` (:mod:`actune.chunked_loss.linear_loss`).
_ABOVE: dict[str, Callable] = {}


def provide(**functions: Callable) -> None:
    """Give this module the functions of :data:`_ABOVE` (called by their modules)."""
    _ABOVE.update(functions)


_HEADS = WeakIdKeyDictionary()  # the marked heads' weights (by identity: tensors' == is
#                                  elementwise)
_HEAD_IDS: set[int] = set()  # their ids: every linear layer asks, most answer in one lookup

_aten = torch.ops.aten
_VIEWS = frozenset({_aten.view.default, _aten._unsafe_view.default, _aten.reshape.default})
_SAME = frozenset({_aten.detach.default, _aten.alias.default})


def mark_head(head: nn.Linear) -> None:
    """Let ``head`` return :class:`LazyLogits` in training: through the linear rule under a
    compressing level, through :func:`lazy_head_forward` at an exact one."""
    _HEADS[head.weight] = True
    _HEAD_IDS.add(id(head.weight))
    head.forward = functools.partial(lazy_head_forward, head)


def unmark_head(head: nn.Linear) -> None:
    _HEADS.pop(head.weight, None)
    _HEAD_IDS.discard(id(head.weight))
    head.__dict__.pop("forward", None)


def is_head(weight: torch.Tensor) -> bool:
    # (an id can outlive its tensor and name another: the weak table decides)
    return id(weight) in _HEAD_IDS and weight in _HEADS


def lazy_head_forward(head: nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
    """A marked head's forward: lazy logits in training at an exact level (no function mode of
    actune's); under a compressing level's mode ``F.linear``'s rule makes them, the head's
    input then packed like any linear layer's; its own forward otherwise."""
    if (torch.compiler.is_compiling() or not torch.is_grad_enabled()
            or not (hidden.requires_grad or head.weight.requires_grad)):
        return F.linear(hidden, head.weight, head.bias)
    level = _ABOVE["active_level"]()
    if level is None or level.exact:
        return LazyHead.apply(hidden, head.weight, head.bias)
    return F.linear(hidden, head.weight, head.bias)


class LazyLogits(torch.Tensor):
    """``F.linear(hidden, weight, bias)`` reshaped by ``steps``, cast to ``dtype``, not yet
    computed (see the module docstring). ``source`` holds the hidden states, weight and bias
    as the graph has them (gradients flow into them from the loss computed in chunks)."""

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    source: tuple
    steps: tuple

    @staticmethod
    def __new__(cls, hidden, weight, bias, source, steps, shape, dtype):
        out = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype,
                                                  device=hidden.device)
        out.hidden, out.weight, out.bias = hidden, weight, bias
        out.source, out.steps = source, steps
        out.value = None  # the logits, once written in place (then they are a plain tensor's)
        return out

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        """``F.cross_entropy`` of lazy logits in chunks where no function mode took it first
        (an exact level: :func:`actune.chunk_loss`'s ``lce``); everything else as PyTorch
        runs it, its results not converted to this class."""
        kwargs = kwargs or {}
        if func is F.cross_entropy and args and isinstance(args[0], LazyLogits):
            out = cross_entropy_in_chunks(*_cross_entropy_args(args, kwargs))
            if out is not None:
                return out
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    def __repr__(self) -> str:  # (printing, a debugger's view: nothing computed; ``+ 0`` is)
        return f"LazyLogits(shape={tuple(self.shape)}, dtype={self.dtype})"

    def _with(self, step: tuple, shape, dtype=None) -> LazyLogits:
        return LazyLogits(self.hidden, self.weight, self.bias, self.source,
                          (*self.steps, step), torch.Size(shape), dtype or self.dtype)

    def hidden_states(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden`` (of the head's input shape) with this tensor's views of the token dims
        applied: the rows whose logits it stands for."""
        for step in self.steps:
            if step[0] == "view":
                hidden = hidden.reshape(*step[1][:-1], hidden.shape[-1])
            elif step[0] == "slice":
                _, dim, start, end, stride = step
                hidden = hidden[(slice(None),) * dim + (slice(start, end, stride),)]
        return hidden

    def materialize(self) -> torch.Tensor:
        """The logits, computed now (whole), or as an in-place op left them."""
        if self.value is not None:
            return self.value
        return F.linear(self.hidden_states(self.hidden), self.weight, self.bias).to(self.dtype)

    def connected(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The hidden states (viewed as this tensor's rows), weight and bias as the autograd
        graph has them."""
        hidden, weight, bias = self.source
        return self.hidden_states(hidden), weight, bias

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        x = args[0] if args else None
        if isinstance(x, LazyLogits) and func._schema.is_mutable:
            # written in place (a soft cap, a mask): the values are kept from now on, and the
            # loss computes them as they are (not in chunks)
            x.value = x.materialize()
            func(x.value, *args[1:], **kwargs)
            return x
        if isinstance(x, LazyLogits) and x.value is None:
            out = _stay_lazy(func, x, args, kwargs)
            if out is not None:
                return return_and_correct_aliasing(func, args, kwargs, out) \
                    if func in _VIEWS or func in _SAME else out
        args, kwargs = tree_map(lambda t: t.materialize() if isinstance(t, LazyLogits) else t,
                                (args, kwargs))
        return func(*args, **kwargs)


def _stay_lazy(func, x: LazyLogits, args: tuple, kwargs: dict) -> LazyLogits | None:
    """``func(x, ...)`` as lazy logits where it only views the token dims or casts; else
    None (computed)."""
    if func in _SAME:
        return x._with(("same",), x.shape)
    if func in _VIEWS:
        shape = _infer(list(args[1]), x.numel())
        if shape is not None and shape[-1] == x.shape[-1]:
            return x._with(("view", tuple(shape)), shape)
        return None
    if func is _aten.slice.Tensor:
        dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
        dim = dim % x.dim()
        start = args[2] if len(args) > 2 else kwargs.get("start")
        end = args[3] if len(args) > 3 else kwargs.get("end")
        stride = args[4] if len(args) > 4 else kwargs.get("step", 1)
        if dim == x.dim() - 1 or not all(v is None or isinstance(v, int)
                                         for v in (start, end, stride)):
            return None
        shape = list(x.shape)
        shape[dim] = len(range(*slice(start, end, stride).indices(x.shape[dim])))
        return x._with(("slice", dim, start, end, stride), shape)
    if func is _aten._to_copy.default and len(args) == 1:
        dtype = kwargs.get("dtype")
        rest = {k: v for k, v in kwargs.items() if k != "dtype"}
        if dtype is not None and dtype.is_floating_point and not rest:
            return x._with(("same",), x.shape, dtype)
    return None


def _cross_entropy_args(args: tuple, kwargs: dict) -> tuple:
    names = ("input", "target", "weight", "size_average", "ignore_index", "reduce",
             "reduction", "label_smoothing")
    defaults = (None, None, None, None, -100, None, "mean", 0.0)
    values = [args[i] if i < len(args) else kwargs.get(n, d)
              for i, (n, d) in enumerate(zip(names, defaults, strict=True))]
    x, target, weight, size_average, ignore_index, reduce, reduction, smoothing = values
    return (x, target, weight, int(ignore_index), reduction, float(smoothing),
            (size_average, reduce))


def cross_entropy_in_chunks(x: LazyLogits, target, weight, ignore_index: int, reduction: str,
                            smoothing: float, legacy: tuple) -> torch.Tensor | None:
    """``F.cross_entropy`` of lazy logits (classes in the last dim) as
    :func:`actune.linear_cross_entropy`, the logits never whole; None where it does not fit
    (logits written in place, class weights, label smoothing, class probabilities as
    targets, legacy arguments): the logits are then computed and the loss runs on them."""
    if (x.value is not None or weight is not None or smoothing or legacy != (None, None)
            or reduction not in ("mean", "sum", "none") or not isinstance(target, torch.Tensor)
            or target.is_floating_point() or target.shape != x.shape[:-1]):
        return None
    hidden, weight, bias = x.connected()
    loss = _ABOVE["linear_cross_entropy"](hidden, weight, target, bias,
                                          ignore_index=ignore_index, reduction=reduction)
    return loss.to(x.dtype)


def _infer(shape: list[int], numel: int) -> list[int] | None:
    if shape.count(-1) > 1:
        return None
    if -1 in shape:
        known = 1
        for s in shape:
            if s != -1:
                known *= s
        if known == 0 or numel % known:
            return None
        shape[shape.index(-1)] = numel // known
    return shape


class LazyHead(torch.autograd.Function):
    """A marked head's ``F.linear(hidden, weight, bias)`` returning :class:`LazyLogits`. Its
    backward runs only where the logits were computed and used: it keeps the hidden states
    for the weight's gradient, packed like any linear layer's input."""

    @staticmethod
    def forward(ctx, hidden, weight, bias):
        ctx.save_for_backward(hidden, weight)
        ctx.has_bias = bias is not None
        dtype = torch.promote_types(hidden.dtype, weight.dtype)
        return LazyLogits(hidden.detach(), weight.detach(),
                          None if bias is None else bias.detach(), (hidden, weight, bias), (),
                          (*hidden.shape[:-1], weight.shape[0]), dtype)

    @staticmethod
    def backward(ctx, grad):
        check_double_backward()
        hidden, weight = ctx.saved_tensors
        needs = ctx.needs_input_grad
        grad_hidden = grad.matmul(weight.to(grad.dtype)).to(hidden.dtype) if needs[0] else None
        rows = grad.reshape(-1, grad.shape[-1])
        grad_weight = (rows.t().matmul(hidden.reshape(-1, hidden.shape[-1]).to(grad.dtype))
                       .to(weight.dtype) if needs[1] else None)
        grad_bias = rows.sum(0) if ctx.has_bias and needs[2] else None
        return grad_hidden, grad_weight, grad_bias
