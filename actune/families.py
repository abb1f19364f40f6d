"""The level a model gets when none is named: L3, except for families whose accuracy at L3 was
measured short of the targets when trained from scratch (docs/benchmarks.md, "Accuracy").

Keyed by a Hugging Face config's ``model_type``; a model without a config (any other
``nn.Module``) gets L3, and so does a model fine-tuned through ``peft`` adapters, whatever its
family (measured apart: docs/benchmarks.md, "A LoRA fine-tune").
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from torch import nn

from actune.levels import Level, get_level

__all__ = ["FAMILY_LEVELS", "FamilyLevel", "adapted", "default_level"]


@dataclass(frozen=True)
class FamilyLevel:
    """A family's default level and the measurement behind it."""

    level: str
    why: str


#: Families whose default is not L3, by ``config.model_type``.
FAMILY_LEVELS: dict[str, FamilyLevel] = {
    "gpt2": FamilyLevel(
        "L2", "byte-level GPT-2, 1,000 steps, 6 seeds: L3's validation loss ends 0.99% above "
              "L0's and the gap widens in the last quarter (half of it the GELU derivative's "
              "rounding); L2 ends 0.13% below, the gap not widening, at 1.2x L3's saved bytes"),
}


def adapted(model: nn.Module) -> bool:
    """Does ``model`` hold ``peft``'s adapter layers (a LoRA model and its kin, the base
    frozen)? False where peft was never imported."""
    tuners = sys.modules.get("peft.tuners.tuners_utils")
    layer = getattr(tuners, "BaseTunerLayer", None)
    return layer is not None and any(isinstance(m, layer) for m in model.modules())


def default_level(model: nn.Module) -> Level:
    """The level :func:`actune.compress` uses for ``model`` when none is given: L3 for a model
    fine-tuned through adapters (:func:`adapted`), else L3 or the level
    :data:`FAMILY_LEVELS` names for the model's family (measured training from scratch)."""
    if adapted(model):
        return get_level("L3")
    config = getattr(model, "config", None)
    family = FAMILY_LEVELS.get(str(getattr(config, "model_type", "")))
    return get_level(family.level if family else "L3")
