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
                lo, hi = _secant(probe, lo, step, maximum, budget)
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


def _secant(probe, lo: int, step: int, maximum: int | None,
            budget: int) -> tuple[int, int | None]:
    """Predict the largest fitting size from peaks: extrapolate a line through the two
    largest fitting probes, then interpolate between the bracket's ends (regula falsi, with a
    bisection whenever one end moves twice in a row). Returns the final (lo, hi) bracket."""
    fit = [(lo, probe(lo).peak)]
    hi = None
    hi_peak = None
    nxt = lo * 2 if maximum is None else min(lo * 2, maximum)
    if nxt == lo:
        return lo, None
    p = probe(nxt)
    if p.fits:
        lo = nxt
        fit.append((nxt, p.peak))
    else:
        hi, hi_peak = nxt, p.peak
    same_side = 0
    last_side = None
    while hi is None or hi - lo > step:
        a, pa = fit[-1]
        if hi is None or hi_peak is None:
            b, pb = fit[-2] if len(fit) > 1 else (None, None)
        else:
            b, pb = hi, hi_peak
        if b is None or pb is None or pb == pa or same_side >= 2:
            if hi is None:
                return lo, None  # no line to follow: grow geometrically instead
            guess = (lo + hi) // 2
            same_side = 0
        else:
            guess = a + (budget - pa) * (b - a) / (pb - pa)
        guess = _round_down(guess, step)
        guess = max(guess, lo + step)
        if hi is not None:
            guess = min(guess, hi - step)
        if maximum is not None:
            if lo >= maximum:
                return lo, None
            guess = min(guess, maximum)
        p = probe(guess)
        side = p.fits
        same_side = same_side + 1 if side == last_side else 1
        last_side = side
        if p.fits:
            lo = guess
            fit.append((guess, p.peak))
        else:
            hi, hi_peak = guess, p.peak
    return lo, hi
