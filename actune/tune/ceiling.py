"""The parameter-state ceiling of a depth or width search: the size at which the parameters,
their gradients and the optimizer's state alone fill the budget, whatever the activations.

Models are built on the ``meta`` device (shapes only, no memory, no initialisation work) and
the size is bisected in the search's units; the caller reads the optimizer's state per
parameter byte off a trial's peak (SGD with momentum: 1, Adam: 2).
"""

from __future__ import annotations

import torch

from actune.tune.workload import Workload

__all__ = ["parameter_bytes", "parameter_state_ceiling"]


def parameter_bytes(workload: Workload, **sizes) -> int:
    """Bytes of the model's parameters at ``sizes``, built on the meta device."""
    with torch.device("meta"):
        model = workload.model(**sizes)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def parameter_state_ceiling(workload: Workload, dim: str, unit: float, budget: int,
                            per_byte: float, limit: int = 1 << 14) -> float | None:
    """The largest ``dim`` (a multiple of ``unit``) at which ``per_byte`` bytes per parameter
    byte (the parameter, its gradient and the optimizer's state: 3 for SGD with momentum,
    each rank's share under FSDP) fit ``budget``; None if even the smallest does not, or past
    ``limit`` units."""

    def fits(n: int) -> bool:
        return parameter_bytes(workload, **{dim: n * unit}) * per_byte <= budget

    if not fits(1):
        return None
    lo, hi = 1, 2
    while fits(hi):
        lo, hi = hi, hi * 2
        if hi > limit:
            return None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo * unit
