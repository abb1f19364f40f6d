"""The level a model gets when none is named, from what the model is made of.

- A model fine-tuned through ``peft`` adapters (any of peft's tuner layers in it) gets L3,
  whatever its base (docs/benchmarks.md, "A LoRA fine-tune").
- A model with a GELU activation module gets L2: every language model of that kind trained
  from scratch at L3 (GPT-2, GPT-NeoX, Phi) ended 0.67-1.71% above L0's validation loss, its
  gap widening, while L2 held within 0.13% (docs/benchmarks.md, "Every family"). Not the
  GELU's derivative itself (kept as codes at L3): GELU marks the plain MLP and layer norms of
  those models, where L3 falls short for reasons not yet found.
- Every other model gets L3 (Llama and Qwen2 within 0.1% of L0).

Recognised by their modules, not by a table of names: a user's own model of either kind is
treated as its kin are.
"""

from __future__ import annotations

import sys

from torch import nn

from actune.levels import Level, get_level

__all__ = ["adapted", "default_level", "gelu_model"]


def adapted(model: nn.Module) -> bool:
    """Does ``model`` hold ``peft``'s adapter layers (a LoRA model and its kin, the base
    frozen)? False where peft was never imported."""
    tuners = sys.modules.get("peft.tuners.tuners_utils")
    layer = getattr(tuners, "BaseTunerLayer", None)
    return layer is not None and any(isinstance(m, layer) for m in model.modules())


def gelu_model(model: nn.Module) -> bool:
    """Does ``model`` hold a GELU activation module: ``nn.GELU``, or a class named for it
    (Hugging Face's ``GELUActivation``, ``NewGELUActivation``, ``BloomGelu``...)? A model that
    calls ``F.gelu`` in its own forward has no such module and is not recognised."""
    return any(_named_gelu(type(m)) for m in model.modules())


def _named_gelu(cls: type) -> bool:
    known = _GELU_CLASSES.get(cls)
    if known is None:
        known = _GELU_CLASSES[cls] = any("gelu" in c.__name__.lower() for c in cls.__mro__)
    return known


_GELU_CLASSES: dict[type, bool] = {}


def default_level(model: nn.Module) -> Level:
    """The level :func:`actune.compress` uses for ``model`` when none is given: L3 for a model
    fine-tuned through adapters (:func:`adapted`), L2 for a model with GELU activations
    (:func:`gelu_model`), else L3 (the module docstring says why)."""
    if adapted(model):
        return get_level("L3")
    return get_level("L2" if gelu_model(model) else "L3")
