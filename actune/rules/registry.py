"""The rule registry: each op's :class:`Rule`, registered by the rule modules of
:mod:`actune.rules` (see its docstring for what a rule holds)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

__all__ = ["CATEGORIES", "RULES", "Rule", "RuleTable", "describe", "funcs_of", "op_name",
           "register"]

#: The ops' categories, in the order docs list them.
CATEGORIES = ("matmul", "norm", "mask", "pooling", "activation", "elementwise", "attention",
              "loss")


@dataclass(frozen=True)
class Rule:
    """How one op's saved tensors are kept (see the module docstring)."""

    category: str
    #: which of the level's widths what the op saves is rounded at: ``"matmul"``,
    #: ``"other"``, ``"zeros"`` (see the package docstring); None keeps it exact
    width: str | None = None
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
    #: the position of the op's weight (or its keyword ``weight``): whatever tensor comes
    #: there stays exact, a parameter or one computed each forward (weight norm's
    #: ``g * v / |v|``), whose rounding would add noise to every input gradient below
    weight_at: int | None = None

    def __post_init__(self) -> None:
        if self.category not in CATEGORIES:
            raise ValueError(f"unknown rule category {self.category!r}; one of {CATEGORIES}")
        if self.width not in (None, "matmul", "other", "zeros"):
            raise ValueError(f"a rule's width must be 'matmul', 'other', 'zeros' or None, not "
                             f"{self.width!r}")


class RuleTable(dict):
    """``func -> Rule``, calling each of its :attr:`listeners` after every change: caches of
    lookups in it (the function mode's, decided once per function) forget what they held
    when a rule is added or removed (a benchmark taking rules out to measure without them)."""

    def __init__(self) -> None:
        super().__init__()
        self.listeners: list[Callable[[], None]] = []

    def _changed(self) -> None:
        for listener in self.listeners:
            listener()

    def __setitem__(self, func, rule) -> None:
        super().__setitem__(func, rule)
        self._changed()

    def __delitem__(self, func) -> None:
        super().__delitem__(func)
        self._changed()

    def __ior__(self, other):
        super().__ior__(other)
        self._changed()
        return self

    def pop(self, *args):
        out = super().pop(*args)
        self._changed()
        return out

    def popitem(self):
        out = super().popitem()
        self._changed()
        return out

    def setdefault(self, func, rule=None):
        out = super().setdefault(func, rule)
        self._changed()
        return out

    def update(self, *args, **kwargs) -> None:
        super().update(*args, **kwargs)
        self._changed()

    def clear(self) -> None:
        super().clear()
        self._changed()


RULES: RuleTable = RuleTable()


def register(funcs: Iterable[Callable], category: str, width: str | None = None, keeps: str = "",
             only_input_shape: bool = False, features_last: bool = False,
             features_last_if: Callable[[tuple], bool] | None = None,
             weight_at: int | None = None):
    """Register a rule for every function in ``funcs``; use as a decorator on the rule's
    ``replace(session, func, args, kwargs, level)`` or call it with the result ignored (a rule
    without a replacement: ``register(...)(None)``)."""
    funcs = tuple(dict.fromkeys(funcs))  # (some spellings are one object: F.relu_)

    def decorate(replace: Callable | None) -> Callable | None:
        rule = Rule(category, width, replace, keeps, only_input_shape, features_last,
                    features_last_if, weight_at)
        for func in funcs:
            if func in RULES:
                raise ValueError(f"{_name(func)} already has a rule ({RULES[func].category})")
            RULES[func] = rule
        return replace

    return decorate


def funcs_of(category: str) -> frozenset:
    """Every function registered under ``category``."""
    return frozenset(f for f, r in RULES.items() if r.category == category)


def describe() -> list[tuple[str, str, str]]:
    """(category, function names, what is kept) per rule, for docs and reports."""
    by_rule: dict[int, tuple[Rule, list[str]]] = {}
    for func, rule in RULES.items():
        by_rule.setdefault(id(rule), (rule, []))[1].append(_name(func))
    rows = [(r.category, ", ".join(sorted(set(names))), r.keeps) for r, names in by_rule.values()]
    return sorted(rows, key=lambda row: CATEGORIES.index(row[0]))


def _name(func: Callable) -> str:
    return getattr(func, "__name__", None) or repr(func)


def op_name(func: Callable) -> str:
    """A short name of a called function for reports (``scaled_dot_product_attention``)."""
    name = _name(func)
    return name.strip("_") or name
