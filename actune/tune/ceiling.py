"""The parameter-state ceiling of a depth or width search: the size at which the parameters,
their gradients and the optimizer's state alone fill the budget, whatever the activations.

Models are built on the ``meta`` device (shapes only, no memory, no initialisation work) and
the size is bisected in the search's units; the caller reads the optimizer's state per
parameter byte off a trial's peak (SGD with momentum: 1, Adam: 2).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from actune.tune.workload import Workload

__all__ = ["parameter_bytes", "parameter_state_ceiling"]


def parameter_bytes(workload: Workload, **sizes) -> int:
    """Bytes of the model's parameters at ``sizes``, built on the meta device."""
    with torch.device("meta"):
        model = workload.model(False, **sizes)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def parameter_state_ceiling(workload: Workload, dim: str, unit: float, budget: int,
                            per_byte: float, limit: int = 1 << 14) -> float | None:
    """The largest ``dim`` (a multiple of ``unit``) at which ``per_byte`` bytes per parameter
    byte (the parameter, its gradient and the optimizer's state: 3 for SGD with momentum,
    each rank's share under FSDP) fit ``budget``; None if even the smallest does not, or past
    ``limit`` units."""

    def state(n: int) -> float:
        return parameter_bytes(workload, **{dim: n * unit}) * per_byte

    def fits(n: int) -> bool:
        return state(n) <= budget

    if not fits(1):
        return None
    # parameter bytes are a polynomial of degree <= 2 in depth or width (once every stage has
    # a block of its own): predict the answer from the default size, twice and four times it
    # (8, 16, 32 eighths), then check it and its neighbour (large builds are slow)
    sizes = (8, 16, 32)
    guess = _solve(sizes, [state(n) for n in sizes], budget)
    if guess is not None and 1 <= guess < limit:  # blocks round per stage: walk to the edge
        up = fits(guess)
        for _ in range(4):
            nxt = guess + 1 if up else guess - 1
            if nxt < 1 or fits(nxt) != up:
                return (guess if up else nxt) * unit
            guess = nxt
    lo, hi = 1, 2
    while fits(hi):
        lo, hi = hi, hi * 2
        if hi > limit:
            return None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo * unit


def _solve(xs: tuple[int, ...], ys: list[float], target: float) -> int | None:
    """The largest integer x where the parabola through (xs, ys) stays within ``target``."""
    a, b, c = np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 2)
    roots = np.roots([a, b, c - target]) if abs(a) > 1e-12 * abs(b or 1) else (
        np.array([(target - c) / b]) if b else np.array([]))
    real = [r.real for r in np.atleast_1d(roots) if abs(r.imag) < 1e-9 and r.real > 0]
    return math.floor(min(real) + 1e-9) if real else None
