"""The largest size that fits: a monotone search over multiples of a step.

``fits(n)`` is assumed monotone (if n fits, every smaller n does). :func:`largest_fitting`
grows geometrically from ``start`` until a size does not fit, then bisects; with peak bytes
available it first fits a line through two probes (or through one and the bytes that do
not grow with the size), predicts the answer and verifies it and its neighbour. Every probe
is recorded.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["Probe", "SearchResult", "largest_fitting"]


@dataclass(frozen=True)
class Probe:
    """One trial: the size, whether it fit, its peak bytes when known, and how much of that
    peak does not grow with the size (``fixed``: a batch search's parameters, gradients and
    optimizer state), which lets one probe predict."""

    size: int
    fits: bool
    peak: int | None = None
    fixed: int | None = None
    # bytes known to grow with the size somewhere in the step (what it keeps for backward):
    # a peak above ``fixed`` by less was set where they are gone (the optimizer's step)
    grows: int | None = None


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
        if maximum < step:
            raise ValueError(f"--max {maximum} is below the step {step}; give a larger --max")
        maximum = _round_down(maximum, step)
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
    """Predict the largest fitting size from peaks (regula falsi).

    A line through the two largest fitting probes is extrapolated to the budget; once a size
    does not fit, the line runs between the two ends of the bracket, or between two
    neighbouring sizes that both fit (the local slope, exact where peaks bend) while it points
    below the smallest size that failed. A prediction that fits is checked by probing the next
    size; an end that moves twice running without closing the bracket is followed by a
    bisection. Returns the (lo, hi) bracket reached (hi None: nothing failed yet, the caller
    grows geometrically).
    """
    start = probe(lo)
    fit = [(lo, start.peak)]
    hi = hi_peak = None
    if (start.fixed is not None and 0 <= start.fixed < start.peak
            and (start.grows is None or start.peak - start.fixed >= start.grows)):
        fit.insert(0, (0, start.fixed))  # the line from the size-independent bytes predicts
    # (else the bytes that grow with the size do not show in the peak, set elsewhere, by the
    # optimizer's step over a large model: such a line would point far past the answer, to
    # sizes whose probes take minutes; a second size gives the line)
    else:  # a second size gives the line
        first = lo * 2 if maximum is None else min(lo * 2, maximum)
        if first == lo:
            return lo, None
        p = probe(first)
        if p.fits:
            lo = first
            fit.append((first, p.peak))
        else:
            hi, hi_peak = first, p.peak
    check = False  # the last probe was a prediction that fit: probe the size after it
    moves: list[bool] = []  # which end each probe moved (True: lo)
    spent = False  # a local slope already fell short inside the bracket
    while hi is None or hi - lo > step:
        if maximum is not None and lo >= maximum:
            return lo, None
        local = None
        if len(fit) > 1 and fit[-1][0] - fit[-2][0] == step:  # two neighbouring sizes fit
            local = (fit[-2], fit[-1])  # the slope where the answer is
            crossing = _crossing(local, budget)
            if hi is not None and (crossing is None or crossing >= hi or spent):
                local = None  # it points past a size that failed, or fell short: use the
                # bracket (one step's slope is coarse where storages are rounded up)
        if local is not None:
            line = local
        elif hi is not None and hi_peak is not None:
            line = (fit[-1], (hi, hi_peak))
        elif hi is None and len(fit) > 1:
            line = (fit[-2], fit[-1])
        else:
            line = None
        stalled = (hi is not None and len(moves) >= 2 and moves[-1] == moves[-2] and not check
                   and local is None)
        guess = None if line is None or stalled else _crossing(line, budget)
        predicted = not check and guess is not None
        if check:
            guess = lo + step
        elif guess is None:
            if hi is None:
                return lo, None
            guess = (lo + hi) // 2  # bisection: no neighbour to check
        guess = max(_round_down(guess, step), lo + step)
        if hi is not None:
            guess = min(guess, hi - step)
        if maximum is not None:
            guess = min(guess, maximum)
        p = probe(guess)
        moves.append(p.fits)
        if p.fits:
            spent = spent or (line is local and local is not None and predicted)
            check = predicted
            lo = guess
            fit.append((guess, p.peak))
        else:
            check = False
            hi, hi_peak = guess, p.peak
    return lo, hi


def _crossing(line: tuple[tuple[int, int], tuple[int, int]], budget: int) -> float | None:
    """Where the line through two (size, peak) points reaches ``budget`` (None if flat)."""
    (a, pa), (b, pb) = line
    if pa == pb:
        return None
    return a + (budget - pa) * (b - a) / (pb - pa)
