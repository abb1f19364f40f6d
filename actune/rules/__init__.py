"""Rules: for each op, what its saved tensors become under :func:`actune.compressed`.

One rule per op family, each in its own module (``matmuls``, ``norms``, ``masks``,
``pooling``, ``activations``, ``elementwise``, ``attention``, ``losses``), registered with
:func:`register` for every spelling of the op (``F.x``, ``torch.x``, ``Tensor.x``, the operator,
in-place variants). The function mode (:mod:`actune.mode`) looks a called function up here once
and otherwise knows nothing of ops:

A unary pointwise op with no rule of its own (``torch.atan``, ``torch.special.erfcx``...) gets
the derivative rule of :mod:`actune.rules.pointwise`, found from PyTorch's op tags.

* ``bits``: which of the level's widths the saved-tensor hooks give what the op saves
  (``"matmul"`` or ``"other"``), for ops whose backward is linear in each saved tensor, so a
  stochastically rounded copy keeps the gradient unbiased; ``"zeros"``: a tensor >= 0 whose
  exact zeros are all its backward reads (ReLU's output), packed with code 0 kept for them,
  at a level with masks and 2 bits or more; ``None`` keeps them exact.
* ``replace``: a function that runs the op through an autograd function saving something
  smaller (a mask, a derivative, packed probabilities); it returns ``None`` to let the op run
  as it is (with ``bits``).
* ``keeps``: what the rule keeps for backward and why that is unbiased or exact (shown in
  docs and in :func:`describe`).
* ``features_last``: what the op saves holds features in its last dim (a linear layer's
  input, a layer norm's): packed one feature at a time, its groups running along the tokens
  (see :func:`actune.quant_columns.feature_order`); ``features_last_if``: a test of the
  call's arguments that says whether they do (a batch norm's ``[batch, features]`` input
  does, an image's ``[N, C, H, W]`` does not).

An op with no rule keeps what it saves exact; :class:`actune.CompressionStats` names it, with
its bytes, so a user sees where the memory is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

__all__ = ["RULES", "Rule", "describe", "funcs_of", "register", "rule_for"]

#: The op families, in the order docs list them.
FAMILIES = ("matmul", "norm", "mask", "pooling", "activation", "elementwise", "attention",
            "loss")


@dataclass(frozen=True)
class Rule:
    """How one op's saved tensors are kept (see the module docstring)."""

    family: str
    bits: str | None = None
    replace: Callable | None = None
    keeps: str = ""
    #: a norm: only the tensor of its input's shape may be rounded (its statistics, read
    #: nonlinearly by backward, stay exact; its weight and buffers stay references)
    only_input_shape: bool = False
    #: the saved tensors' last dim holds features: group along the other dims (one feature's
    #: values share a group's range, as a convolution's NCHW input does by its layout)
    features_last: bool = False
    #: or a test of the call's arguments saying whether it does (None: ``features_last``)
    features_last_if: Callable[[tuple], bool] | None = None

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"unknown rule family {self.family!r}; one of {FAMILIES}")
        if self.bits not in (None, "matmul", "other", "zeros"):
            raise ValueError(f"rule bits must be 'matmul', 'other', 'zeros' or None, not "
                             f"{self.bits!r}")


RULES: dict[Callable, Rule] = {}


def register(funcs: Iterable[Callable], family: str, bits: str | None = None, keeps: str = "",
             only_input_shape: bool = False, features_last: bool = False,
             features_last_if: Callable[[tuple], bool] | None = None):
    """Register a rule for every function in ``funcs``; use as a decorator on the rule's
    ``replace(session, func, args, kwargs, level)`` or call it with the result ignored (a rule
    without a replacement: ``register(...)(None)``)."""
    funcs = tuple(dict.fromkeys(funcs))  # (some spellings are one object: F.relu_)

    def decorate(replace: Callable | None) -> Callable | None:
        rule = Rule(family, bits, replace, keeps, only_input_shape, features_last,
                    features_last_if)
        for func in funcs:
            if func in RULES:
                raise ValueError(f"{_name(func)} already has a rule ({RULES[func].family})")
            RULES[func] = rule
        return replace

    return decorate


def rule_for(func: Callable) -> Rule | None:
    """The rule of ``func``: its own, else the derivative rule of a unary pointwise op
    (:func:`actune.rules.pointwise.generic_rule`), else None (what it saves stays exact)."""
    rule = RULES.get(func)
    return rule if rule is not None else generic_rule(func)


def funcs_of(family: str) -> frozenset:
    """Every function registered under ``family``."""
    return frozenset(f for f, r in RULES.items() if r.family == family)


def describe() -> list[tuple[str, str, str]]:
    """(family, function names, what is kept) per rule, for docs and reports."""
    by_rule: dict[int, tuple[Rule, list[str]]] = {}
    for func, rule in RULES.items():
        by_rule.setdefault(id(rule), (rule, []))[1].append(_name(func))
    rows = [(r.family, ", ".join(sorted(set(names))), r.keeps) for r, names in by_rule.values()]
    return sorted(rows, key=lambda row: FAMILIES.index(row[0]))


def _name(func: Callable) -> str:
    return getattr(func, "__name__", None) or repr(func)


def op_name(func: Callable) -> str:
    """A short name of a called function for reports (``scaled_dot_product_attention``)."""
    name = _name(func)
    return name.strip("_") or name


# The families register themselves on import (each module is small and self-contained).
from actune.rules import (  # noqa: E402, F401
    activations,
    attention,
    elementwise,
    losses,
    masks,
    matmuls,
    norms,
    pointwise,
    pooling,
)
from actune.rules.pointwise import generic_rule  # noqa: E402
