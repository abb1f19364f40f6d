"""Which blocks a ``+ckpt`` configuration checkpoints: every block, except those whose
recomputation sets the step's peak.

A checkpointed block keeps only its input, and recomputes its forward in backward with the
incoming gradient alive beside the tensors that forward works with. Where the level already
keeps what a block saves small (L3's 2 bits), that recomputation can hold more than the block
would have saved: ResNet-50's 56x56 bottlenecks, recomputed, hold the gradient, the block's
input and a batch norm's input and output, four full-size tensors where L3's forward holds
three. So, in an estimate, at the batch the search found: while the peak is in the backward of
a checkpointed block, run that block whole and estimate again; keep the change only if the
peak fell. Last, running every block whole (the level alone) is tried too. The tuner does this
at the answer its search found, then searches again, and chooses again at the new answer (up
to three rounds): at a batch far below the answer the optimizer step can hold the peak, and
the choices tie there.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

from actune.memory import Peak
from actune.tune.alternatives import Config
from actune.tune.probe import Trial, blocks_of

__all__ = ["block_at", "block_names", "describe_whole", "fewer_checkpoints"]


def block_names(trial: Trial) -> list[str]:
    """The names in the model of ``trial``'s blocks (what ``ckpt`` checkpoints), in order."""
    model = trial.meter.model
    names = {id(m): n for n, m in model.named_modules()}
    return [names[id(b)] for b in blocks_of(trial.workload, model) if id(b) in names]


def block_at(where: str, names: Iterable[str]) -> str | None:
    """The block among ``names`` whose backward a peak's place (``Peak.where``: "backward,
    layer1.2.bn3 (BatchNorm2d)") is in; None in forward, in the optimizer step or outside
    every block."""
    phase, _, place = where.partition(", ")
    if phase != "backward":
        return None
    path = place.split(" (")[0]
    inside = [n for n in names if path == n or path.startswith(n + ".")]
    return max(inside, key=len, default=None)


def _fit(peak_of: Callable[[Config], Peak], config: Config) -> tuple[float, Peak | None]:
    try:
        peak = peak_of(config)
    except Exception:  # (out of memory, or a step that fails this way: not a better choice)
        return float("inf"), None
    return peak.fit_bytes, peak


def fewer_checkpoints(config: Config, peak_of: Callable[[Config], Peak],
                      names: list[str]) -> Config:
    """``config`` (with ``checkpoint``) with the blocks whose recomputation set the peak run
    whole, as long as each change lowers ``peak_of`` (a step's peak at one batch); the level
    alone (every block whole) if that is lower still."""
    best = config
    best_fit, peak = _fit(peak_of, config)
    while peak is not None:
        name = block_at(peak.where, names)
        if name is None or name in best.whole:
            break
        tried = dataclasses.replace(best, whole=(*best.whole, name))
        fit, found = _fit(peak_of, tried)
        if fit >= best_fit:
            break
        best, best_fit, peak = tried, fit, found
    if best.whole != tuple(names):
        alone = dataclasses.replace(config, whole=tuple(names))
        if _fit(peak_of, alone)[0] < best_fit:
            return alone
    return best


def describe_whole(whole: tuple[str, ...], blocks: int, shown: int = 6) -> str:
    """``"13 of 16 blocks checkpointed; run whole (...): layer1.0, layer1.1, layer1.2"``."""
    if len(whole) == blocks:
        return (f"no block checkpointed: the level alone peaks lower than checkpointing any "
                f"block tried (of {blocks})")
    names = ", ".join(whole[:shown]) + (f" and {len(whole) - shown} more"
                                        if len(whole) > shown else "")
    return (f"{blocks - len(whole)} of {blocks} blocks checkpointed; run whole (their "
            f"recomputation set the peak): {names}")
