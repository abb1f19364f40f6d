"""Layers written inline as chains of elementwise ops, computed as one op instead.

Hugging Face writes some layers as a chain of tensor ops, each saving its own operands: GPT-2's
``gelu_new`` saves five tensors of the MLP's width, Llama's RMSNorm three of the model's (and
rounds each separately, with the per-token statistic's gradient summed from rounded inputs).
The same function computed by one op (``F.gelu(approximate="tanh")``, ``F.rms_norm``) saves
one packed tensor under its rule. Classes are keyed by module and class name, so nothing here
imports their library.

:func:`compress` converts such modules to counterparts that call the one op. Under
:func:`actune.compressed` alone, :func:`fused_modules` does the same at run time: global
each listed class's forward computes the one op instead of its chain while a block is open
(the class's own forward otherwise). On fake tensors too: the tuner's estimates run what a
real step runs.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

__all__ = ["FUSED", "Fused", "class_name", "fused_modules", "fused_of"]


def _eps(module: nn.Module) -> float | None:
    """The module's epsilon: Hugging Face's ``variance_epsilon`` (a plain attribute, read
    without a failed lookup: the module's ``__getattr__`` raises for a missing name), else
    ``eps``."""
    eps = module.__dict__.get("variance_epsilon")
    return getattr(module, "eps", None) if eps is None else eps


#: A block reading tensors' metadata alone (dtype, shape) with no function mode told of each
#: read: a module's forward runs outside the mode's own handling, where every such read under
#: ``compressed()`` would be a call of the mode.
_metadata_only = torch._C.DisableTorchFunction


def _rms_norm(module: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """Hugging Face's ``weight * rms_normalised(x)`` as one ``F.rms_norm``; None where it
    does not fit (not where the dtypes differ, as under autocast): the module's own code then
    runs."""
    weight = module._parameters.get("weight")
    eps = _eps(module)
    if weight is None or eps is None:
        return None
    with _metadata_only():
        if weight.dtype != x.dtype:
            return None
        features = x.shape[-1]
    # (torch's builtin: the function mode sees it with none of torch.nn.functional's Python
    # dispatch around it; the rule is the same)
    return torch.rms_norm(x, (features,), weight, float(eps))


def _tanh_gelu(_module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


class Fused(NamedTuple):
    """A listed class: what its one op keeps, and the op (it returns None where it does not
    fit the call: the module's own code then runs)."""

    keeps: str
    run: Callable[[nn.Module, torch.Tensor], torch.Tensor | None]


#: class name -> :class:`Fused`.
FUSED: dict[str, Fused] = {
    **{f"transformers.activations.{name}": Fused(
        "packed derivative (other bits): the inline tanh GELU computed as "
        "F.gelu(approximate='tanh')", _tanh_gelu)
       for name in ("NewGELUActivation", "FastGELUActivation")},
    # Bloom's tanh GELU, an autograd function of its own that keeps its input exact
    "transformers.models.bloom.modeling_bloom.BloomGelu": Fused(
        "packed derivative (other bits): Bloom's tanh GELU computed as "
        "F.gelu(approximate='tanh')", _tanh_gelu),
    # weight * x * rsqrt(mean(x**2) + eps), statistics in float32 (not Gemma's 1 + weight)
    **{f"transformers.models.{family}.modeling_{family}.{name}RMSNorm": Fused(
        "packed normalised input (other bits), shared with the matmul reading the output: "
        "the inline RMSNorm computed as F.rms_norm", _rms_norm)
       for family, name in (("llama", "Llama"), ("mistral", "Mistral"), ("qwen2", "Qwen2"),
                            ("qwen3", "Qwen3"), ("mixtral", "Mixtral"), ("phi3", "Phi3"))},
}


def class_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def fused_of(cls: type) -> Callable | None:
    """The one-op function standing in for ``cls``'s inline chain (or None), through its
    ancestors."""
    return next((FUSED[class_name(a)].run for a in cls.__mro__ if class_name(a) in FUSED),
                None)


_local = threading.local()


def _fusing_forward(own: Callable, entry: Fused) -> Callable:
    """A listed class's forward under :func:`fused_modules`: the one op where a block wants
    it and it fits the call, else the class's own forward (``own``), as it was."""
    @functools.wraps(own)
    def forward(self, *args, **kwargs):
        if torch.compiler.is_compiling():
            return own(self, *args, **kwargs)  # (compiled: its own chain, under the traced rules)
        when = getattr(_local, "when", None)
        if (when is not None and len(args) == 1 and not kwargs
                and isinstance(args[0], torch.Tensor) and torch.is_grad_enabled()):
            with _metadata_only():
                floating = args[0].is_floating_point()
            if floating and when():
                out = entry.run(self, args[0])
                if out is not None:
                    return out
        return own(self, *args, **kwargs)

    forward.__actune_own_forward__ = own
    return forward


_lock = threading.Lock()
#: listed class -> its own forward, for the classes whose forward is :func:`_fusing_forward`'s
_FUSING: dict[type, Callable] = {}
_checked_at = [-1]  # len(sys.modules) at the last look for newly imported listed classes


def _take_over_loaded_classes() -> None:
    """Give each listed class imported so far the fusing forward (once; then kept)."""
    if _checked_at[0] == len(sys.modules):
        return  # (nothing imported since the last look: most block entries)
    with _lock:
        _checked_at[0] = len(sys.modules)
        for name, entry in FUSED.items():
            module_name, _, qualname = name.rpartition(".")
            cls = getattr(sys.modules.get(module_name), qualname, None)
            if isinstance(cls, type) and cls not in _FUSING and "forward" in cls.__dict__:
                own = cls.__dict__["forward"]
                _FUSING[cls] = own
                cls.forward = _fusing_forward(own, entry)


@contextlib.contextmanager
def fused_modules(when: Callable[[], bool]) -> Iterator[None]:
    """While open, listed modules (:data:`FUSED`) called in this thread compute their one op
    in place of their chain, where ``when()`` says so at their call (not in a checkpointed
    region, whose recomputation must save what its forward saved). Each listed class
    imported by the time a block opens gets a forward that asks this first, and keeps it
    (outside a block: one attribute read more a call): no module hook, so every other
    module call keeps PyTorch's path, and nothing ``torch.compile`` guards on changes from
    one step to the next."""
    _take_over_loaded_classes()
    outer, _local.when = getattr(_local, "when", None), when
    try:
        yield
    finally:
        _local.when = outer
