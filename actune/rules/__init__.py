"""Rules: for each op, what its saved tensors become under :func:`actune.compressed`.

One rule per category of ops, each in its own module (``matmuls``, ``norms``, ``masks``,
``pooling``, ``activations``, ``elementwise``, ``attention``, ``losses``), registered with
:func:`register` for every spelling of the op (``F.x``, ``torch.x``, ``Tensor.x``, the operator,
in-place variants). The function mode (:mod:`actune.session.routing`) looks a called function up
here once
and otherwise knows nothing of ops:

A unary pointwise op with no rule of its own (``torch.atan``, ``torch.special.erfcx``...) gets
the derivative rule of :mod:`actune.rules.pointwise`, found from PyTorch's op tags.

* ``width``: which of the level's widths the saved-tensor hooks give what the op saves
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
  (see :func:`actune.packing.columns.feature_order`); ``features_last_if``: a test of the
  call's arguments that says whether they do (a batch norm's ``[batch, features]`` input
  does, an image's ``[N, C, H, W]`` does not).

An op with no rule keeps what it saves exact; :class:`actune.CompressionStats` names it, with
its bytes, so a user sees where the memory is.
"""

from __future__ import annotations

from collections.abc import Callable

# The rule modules register themselves on import (each is small and self-contained).
from actune.rules import (  # noqa: F401
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
from actune.rules.pointwise import generic_rule
from actune.rules.registry import (
    CATEGORIES,
    RULES,
    Rule,
    describe,
    funcs_of,
    op_name,
    register,
)

__all__ = ["CATEGORIES", "RULES", "Rule", "describe", "funcs_of", "op_name", "register",
           "rule_for"]


def rule_for(func: Callable) -> Rule | None:
    """The rule of ``func``: its own, else the derivative rule of a unary pointwise op
    (:func:`actune.rules.pointwise.generic_rule`), else None (what it saves stays exact)."""
    rule = RULES.get(func)
    return rule if rule is not None else generic_rule(func)
