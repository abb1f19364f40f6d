"""The bit allocation problem of mixed precision, apart from any training run: the variance
model ``sum C / (2**b - 1)**2`` (plus a quartic term) and the multiple-choice knapsack that
chooses ``b`` in {1, 2, 4, 8} per item under an average-bits budget (ActNN, ICML 2021,
section 4). NumPy only; :mod:`actune.autoprec.allocator` estimates the costs from a training step.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import numpy as np

from actune import tunables

__all__ = ["CHOICES", "NOISE", "NOISE4", "allocate", "non_increasing", "objective", "widest"]

#: Bit widths the allocator chooses from (those the kernels pack).
CHOICES = (1, 2, 4, 8)
NOISE = {0: 0.0, **{b: 1.0 / (2**b - 1) ** 2 for b in CHOICES}}  # 0: a mask only
NOISE4 = {b: v * v for b, v in NOISE.items()}


def objective(costs: Sequence[float], bits: Sequence[int],
              quartic: Sequence[float] | None = None) -> float:
    """The variance model: ``sum costs / (2**bits - 1)**2 + quartic / (2**bits - 1)**4``."""
    q = np.zeros(len(costs)) if quartic is None else quartic
    return float(sum(c * NOISE[int(b)] + k * NOISE4[int(b)]
                     for c, k, b in zip(costs, q, bits, strict=True)))


def allocate(costs: Sequence[float], numel: Sequence[int], avg_bits: float,
             min_bits: Sequence[int] | int = 1,
             quartic: Sequence[float] | None = None) -> np.ndarray:
    """Bits in {1, 2, 4, 8} per item minimising ``sum costs / (2**bits - 1)**2`` (plus
    ``quartic / (2**bits - 1)**4`` where given) subject to
    ``sum bits * numel <= avg_bits * sum numel`` and ``bits >= min_bits``.

    Small problems are solved exactly (dynamic programming over the bit budget); large ones
    greedily by variance saved per bit spent, which is optimal up to the last upgrade that no
    longer fits (the marginal saving of each item falls with every upgrade).
    """
    c = np.asarray(costs, dtype=np.float64).reshape(-1)
    n = np.asarray(numel, dtype=np.int64).reshape(-1)
    lo = np.broadcast_to(np.asarray(min_bits, dtype=np.int64), c.shape).copy()
    q = np.zeros_like(c) if quartic is None else np.asarray(quartic, np.float64).reshape(-1)
    if c.shape != n.shape or q.shape != c.shape:
        raise ValueError(f"costs and numel differ in length ({c.size} vs {n.size})")
    if c.size == 0:
        return np.zeros(0, dtype=np.int64)
    if not (np.all(np.isfinite(c)) and np.all(np.isfinite(q))) or np.any(c < 0) or np.any(q < 0):
        raise ValueError("costs must be finite and >= 0")
    if np.any(n <= 0):
        raise ValueError("numel must be positive")
    if not set(lo.tolist()) <= set(CHOICES):
        raise ValueError(f"min_bits must be in {CHOICES}")
    total = int(n.sum())
    capacity = math.floor(avg_bits * total + 1e-9 * total)
    floor_bits = int((lo * n).sum())
    if capacity < floor_bits:
        raise ValueError(f"{avg_bits} bits on average is below the minimum these tensors "
                         f"allow ({floor_bits / total:.3g}: tensors that keep exact zeros "
                         f"need 2 bits)")
    unit = int(np.gcd.reduce(n))
    cells = capacity // unit + 1
    # variance of each item at each width (falls, and ever more slowly, as bits double)
    var = np.stack([c * NOISE[b] + q * NOISE4[b] for b in CHOICES], axis=1)
    if c.size * cells <= tunables.EXACT_CELLS:
        return _exact(var, n // unit, capacity // unit, lo)
    return _greedy(var, n, capacity, lo)


def _exact(var: np.ndarray, n: np.ndarray, cap: int, lo: np.ndarray) -> np.ndarray:
    """Multiple-choice knapsack by dynamic programming over used capacity (units of n)."""
    best = np.zeros(cap + 1)  # best[u]: least variance of the items so far within u units
    items = var.shape[0]
    choice = np.zeros((items, cap + 1), dtype=np.int8)
    for i in range(items):
        new = np.full(cap + 1, np.inf)
        for k, b in enumerate(CHOICES):
            w = b * int(n[i])
            if b < lo[i] or w > cap:
                continue
            cand = np.full(cap + 1, np.inf)
            cand[w:] = best[:cap + 1 - w] + var[i, k]
            better = cand < new
            new[better] = cand[better]
            choice[i, better] = k
        best = new
    bits = np.zeros(items, dtype=np.int64)
    u = cap
    for i in range(items - 1, -1, -1):
        b = CHOICES[choice[i, u]]
        bits[i] = b
        u -= b * int(n[i])
    return bits


def _greedy(var: np.ndarray, n: np.ndarray, cap: int, lo: np.ndarray) -> np.ndarray:
    """Take upgrades (1->2, 2->4, 4->8 bits) in order of variance saved per bit spent."""
    level = np.array([CHOICES.index(int(b)) for b in lo])
    used = int((lo * n).sum())
    steps = []  # (saving per bit, item, step index, cost)
    for k in range(len(CHOICES) - 1):
        a, b = CHOICES[k], CHOICES[k + 1]
        ok = level <= k
        gain = var[:, k] - var[:, k + 1]
        cost = n * (b - a)
        for i in np.flatnonzero(ok & (gain > 0)):
            steps.append((gain[i] / cost[i], int(i), k, int(cost[i])))
    steps.sort(key=lambda s: -s[0])
    for _ratio, i, k, cost in steps:
        if level[i] == k and used + cost <= cap:
            level[i] = k + 1
            used += cost
    return np.array([CHOICES[k] for k in level], dtype=np.int64)


@functools.lru_cache(maxsize=256)  # (asked for every tensor a step packs)
def widest(bits: float, min_bits: int = 1) -> int:
    """The widest packable width not above ``bits`` (at least ``min_bits``)."""
    return max(max((b for b in CHOICES if b <= bits), default=CHOICES[0]), min_bits)


def non_increasing(values: np.ndarray) -> np.ndarray:
    """The least-squares non-increasing fit of ``values`` (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, count]
    for v in values.tolist():
        blocks.append([v, 1])
        while len(blocks) > 1 and blocks[-2][0] < blocks[-1][0]:
            m2, n2 = blocks.pop()
            m1, n1 = blocks.pop()
            blocks.append([(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2])
    return np.concatenate([np.full(n, m) for m, n in blocks]) if blocks else values.copy()
