"""The level a model gets when none is named.

- A model fine-tuned through ``peft`` adapters (any of peft's tuner layers in it) gets L3,
  whatever its base (docs/benchmarks.md, "A LoRA fine-tune").
- A Hugging Face model of a family measured short of the goal at L3 (validation loss within
  0.5% of L0's, trained from scratch) gets the level measured to hold it: :data:`SHORT_AT_L3`,
  recognised by its configuration's ``model_type``. One family is there: Phi
  (docs/benchmarks.md, "Every family").
- Every other model gets L3: Llama, Qwen2, GPT-2, GPT-NeoX and BERT hold it (same section);
  a user's own model is treated as its kin are.
"""

from __future__ import annotations

import sys

from torch import nn

from actune.levels import Level, get_level

__all__ = ["SHORT_AT_L3", "adapted", "default_level"]

#: Hugging Face ``model_type`` -> the level it gets by default: the families whose L3 was
#: measured short of the goal, each with the level that held (docs/benchmarks.md)
SHORT_AT_L3: dict[str, str] = {"phi": "L2"}


def adapted(model: nn.Module) -> bool:
    """Does ``model`` hold ``peft``'s adapter layers (a LoRA model and its kin, the base
    frozen)? False where peft was never imported."""
    tuners = sys.modules.get("peft.tuners.tuners_utils")
    layer = getattr(tuners, "BaseTunerLayer", None)
    return layer is not None and any(isinstance(m, layer) for m in model.modules())


def default_level(model: nn.Module) -> Level:
    """The level :func:`actune.compress` uses for ``model`` when none is given: L3, unless
    ``model`` is a Hugging Face model of a family in :data:`SHORT_AT_L3` not fine-tuned through
    adapters (:func:`adapted`; the module docstring says why)."""
    family = getattr(getattr(model, "config", None), "model_type", None)
    if family in SHORT_AT_L3 and not adapted(model):
        return get_level(SHORT_AT_L3[family])
    return get_level("L3")
