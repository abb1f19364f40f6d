"""Layers written inline as chains of elementwise ops, computed as one op instead.

Hugging Face writes some layers as a chain of tensor ops, each saving its own operands: GPT-2's
``gelu_new`` saves five tensors of the MLP's width, Llama's RMSNorm three of the model's (and
rounds each separately, with the per-token statistic's gradient summed from rounded inputs).
The same function computed by one op (``F.gelu(approximate="tanh")``, ``F.rms_norm``) saves
one packed tensor under its rule. Classes are keyed by module and class name, so nothing here
imports their library.

:func:`compress` converts such modules to counterparts that call the one op. Under
:func:`actune.compressed` alone, :func:`fused_modules` does the same at run time: global
module hooks run a listed module's own forward without recording gradients, and hand on the
one op's output (recorded, under the rules) in its place. Its own forward's values are the
same (a few elementwise ops, computed twice). On fake tensors too: the tuner's estimates run
what a real step runs.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn
from torch.nn.modules import module as nn_module

__all__ = ["FUSED", "Fused", "class_name", "fused_modules", "fused_of"]


def _eps(module: nn.Module) -> float | None:
    return getattr(module, "variance_epsilon", getattr(module, "eps", None))


def _rms_norm_fits(module: nn.Module, x: torch.Tensor) -> bool:
    """Can ``F.rms_norm`` stand in (not where the dtypes differ, as under autocast)?"""
    weight = getattr(module, "weight", None)
    return isinstance(weight, torch.Tensor) and weight.dtype == x.dtype and _eps(module) is not None


def _rms_norm(module: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """Hugging Face's ``weight * rms_normalised(x)`` as one ``F.rms_norm`` (None where it does
    not fit: the module's own code then runs)."""
    if not _rms_norm_fits(module, x):
        return None
    return F.rms_norm(x, (x.shape[-1],), module.weight, float(_eps(module)))


def _tanh_gelu(_module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


class Fused(NamedTuple):
    """A listed class: what its one op keeps, the op (None where it does not fit), and
    whether it fits a call (checked before the module's own code runs)."""

    keeps: str
    run: Callable[[nn.Module, torch.Tensor], torch.Tensor | None]
    fits: Callable[[nn.Module, torch.Tensor], bool] = lambda _m, _x: True


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
        "the inline RMSNorm computed as F.rms_norm", _rms_norm, _rms_norm_fits)
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


def _stack() -> list:
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


def _entry_of(cls: type) -> Fused | None:
    """The :data:`FUSED` entry of exactly ``cls`` (converted classes run the op themselves),
    looked up by name once per class: the hooks run at every module call, and the table is
    filled at import."""
    entry = _ENTRIES.get(cls, _UNSEEN)
    if entry is _UNSEEN:
        entry = _ENTRIES[cls] = FUSED.get(class_name(cls))
    return entry


_ENTRIES: dict[type, Fused | None] = {}
_UNSEEN = object()


def _pre_hook(module: nn.Module, args: tuple) -> None:
    if torch.compiler.is_compiling():
        return  # (compiled: the module's own chain, under the traced rules)
    when = getattr(_local, "when", None)
    if when is None:
        return  # no compressed() open in this thread (another's installed the hooks)
    entry = _ENTRIES.get(type(module), _UNSEEN)
    if entry is _UNSEEN:
        entry = _entry_of(type(module))
    if entry is None:
        return  # (most modules: nothing pushed, nothing for the post-hook to pop)
    fn = None
    if (len(args) == 1 and isinstance(args[0], torch.Tensor)
            and torch.is_grad_enabled() and args[0].is_floating_point()
            and entry.fits(module, args[0]) and when()):
        fn = entry.run
    _stack().append((module, fn))
    if fn is not None:
        torch.set_grad_enabled(False)  # the module's own chain: values only


def _post_hook(module: nn.Module, args: tuple, output):
    if torch.compiler.is_compiling() or getattr(_local, "when", None) is None:
        return None
    if _ENTRIES.get(type(module)) is None:
        return None  # (no entry, or a class the pre-hook has not seen: nothing pushed)
    stack = _stack()
    if not stack or stack[-1][0] is not module:
        return None  # (entered before the hooks were installed)
    _, fn = stack.pop()
    if fn is None:
        return None
    torch.set_grad_enabled(True)
    if output is None:  # (the forward raised: hooks called always get no output)
        return None
    return fn(module, args[0])


_lock = threading.Lock()
_installed: list = []  # [pre handle, post handle] once any thread has needed them


@contextlib.contextmanager
def fused_modules(when: Callable[[], bool]) -> Iterator[None]:
    """While open, listed modules (:data:`FUSED`) called in this thread compute their one op
    in place of their chain, where ``when()`` says so at their call (not in a checkpointed
    region, whose recomputation must save what its forward saved). Global module hooks,
    installed once and then kept (a few attribute reads per module call where no block is
    open): hooks added and removed around every step would make ``torch.compile`` guard on
    new ones each time and compile the model again."""
    with _lock:
        if not _installed:
            _installed.extend([nn_module.register_module_forward_pre_hook(_pre_hook),
                               nn_module.register_module_forward_hook(_post_hook,
                                                                      always_call=True)])
    outer, _local.when = getattr(_local, "when", None), when
    try:
        yield
    finally:
        _local.when = outer
