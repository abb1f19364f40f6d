"""Training precisions by Lightning's names: how a step runs its forward, loss and backward."""

from __future__ import annotations

import contextlib

import torch

__all__ = ["PRECISIONS", "autocast", "cast_model", "scaler"]

#: name -> (autocast dtype or None, parameter dtype or None)
PRECISIONS: dict[str, tuple[torch.dtype | None, torch.dtype | None]] = {
    "32-true": (None, None), "bf16-mixed": (torch.bfloat16, None),
    "16-mixed": (torch.float16, None), "bf16-true": (None, torch.bfloat16)}


def autocast(precision: str, device_type: str):
    """The context a mixed precision runs forward and loss in (a no-op for the others)."""
    dtype = PRECISIONS[precision][0]
    return contextlib.nullcontext() if dtype is None else torch.autocast(device_type, dtype)


def cast_model(precision: str, model: torch.nn.Module) -> torch.nn.Module:
    """``model`` in the precision's parameter dtype (``bf16-true``), else as it is."""
    dtype = PRECISIONS[precision][1]
    return model if dtype is None else model.to(dtype)


def scaler(precision: str, device_type: str) -> torch.amp.GradScaler | None:
    """A GradScaler for ``16-mixed`` (float16 gradients underflow without one), else None."""
    return torch.amp.GradScaler(device_type) if precision == "16-mixed" else None
