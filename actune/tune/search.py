"""The largest size that fits: a monotone search over multiples of a step.

``fits(n)`` is assumed monotone (if n fits, every smaller n does). :func:`largest_fitting`
grows geometrically from ``start`` until a size does not fit, then bisects; with peak bytes
available (estimate mode) it first fits a line through two probes, predicts the answer and
verifies it with at most two more. Every probe is recorded.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["Probe", "SearchResult", "largest_fitting"]


@dataclass(frozen=True)
class Probe:
    """One trial: the size, whether it fit, and its peak bytes when known."""

    size: int
    fits: bool
    peak: int | None = None


@dataclass
class SearchResult:
    """The largest fitting size (None when even the smallest does not fit) and the probes."""

    value: int | None
    probes: list[Probe] = field(default_factory=list)
    capped: bool = False  # the answer is the --max cap, larger sizes were not tried
    complete: bool = True  # False when interrupted: ``value`` is the best found so far


def _round_down(n: float, step: int) -> int:
    return int(n // step) * step


def largest_fitting(trial: Callable[[int], Probe], *, start: int = 1, step: int = 1,
                    maximum: int | None = None, budget: int | None = None,
                    on_probe: Callable[[Probe], None] | None = None) -> SearchResult:
    """Largest multiple of ``step`` (from ``start``, at most ``maximum``) for which
    ``trial(size).fits``. With ``budget`` and peaks in the probes, predicts from a line fit."""
    if step < 1 or start < 1:
        raise ValueError("start and step must be at least 1")
    result = SearchResult(None)
    known: dict[int, Probe] = {}

    def probe(n: int) -> Probe:
        if n not in known:
            p = trial(n)
            known[n] = p
            result.probes.append(p)
            if on_probe:
                on_probe(p)
        return known[n]

    lo = None  # largest size known to fit
    hi = None  # smallest size known not to fit
    n = max(step, _round_down(start, step) or step)
    if maximum is not None:
        maximum = _round_down(maximum, step)
        if maximum < step:
            raise ValueError(f"--max {maximum} is below the step {step}")
        n = min(n, maximum)

    try:
        first = probe(n)
        if not first.fits:
            hi = n
            if n == step:
                return result
            lo_try = step
            if not probe(lo_try).fits:
                return result
            lo = lo_try
        else:
            lo = n
            if budget is not None and first.peak is not None:
                lo, hi = _predict(probe, n, step, maximum, budget, lo)
        # grow geometrically until something does not fit (or the cap)
        while hi is None:
            if maximum is not None and lo >= maximum:
                result.value, result.capped = lo, True
                return result
            nxt = lo * 2 if maximum is None else min(lo * 2, maximum)
            if probe(nxt).fits:
                lo = nxt
            else:
                hi = nxt
        # bisect between lo (fits) and hi (does not)
        while hi - lo > step:
            mid = _round_down((lo + hi) // 2, step)
            if mid <= lo:
                mid = lo + step
            if probe(mid).fits:
                lo = mid
            else:
                hi = mid
        result.value = lo
        return result
    except KeyboardInterrupt:
        fitting = [p.size for p in result.probes if p.fits]
        result.value = max(fitting) if fitting else None
        result.complete = False
        return result


def _predict(probe, n1: int, step: int, maximum: int | None, budget: int,
             lo: int) -> tuple[int, int | None]:
    """Fit peak = a + b * n through two probes; check the predicted largest size and the next.

    Returns the (lo, hi) bracket to continue from (hi None when nothing failed yet).
    """
    p1 = probe(n1)
    n2 = n1 * 2 if maximum is None else min(n1 * 2, maximum)
    if n2 == n1:
        return lo, None
    p2 = probe(n2)
    if not p2.fits:
        return lo, n2
    lo = n2
    slope = (p2.peak - p1.peak) / (n2 - n1)
    if slope <= 0:
        return lo, None
    guess = _round_down(n2 + (budget - p2.peak) / slope, step)
    if maximum is not None:
        guess = min(guess, maximum)
    if guess <= lo:
        return lo, None
    if probe(guess).fits:
        lo = guess
        if maximum is not None and guess >= maximum:
            return lo, None
        after = guess + step
        return (lo, after) if not probe(after).fits else (after, None)
    return lo, guess
