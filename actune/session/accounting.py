"""The session's accounting: what autograd would have kept (each storage once) and what is
kept instead, read by a statistics sink and by the bit allocator's budget."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from actune import tunables
from actune.formatting import describe_exact
from actune.traced.pack import group_statistic, packed_origin

__all__ = ["OUTSIDE", "Accounting", "CompressionStats", "storage_key"]

#: The label of a tensor saved outside any routed op (a custom function's save_for_backward).
OUTSIDE = "(saved outside any op)"


@dataclass
class CompressionStats:
    """Bytes autograd would have kept, and what was kept instead, during one context.

    ``exact`` names what stayed exact although it was large (``min_numel`` elements or more),
    by the op that saved it, in bytes; ``small_bytes`` is what stayed exact for being small."""

    saved_bytes: int = 0  # bytes of the tensors handed to the pack hook (each storage once)
    kept_bytes: int = 0  # bytes actually held: packed forms plus tensors kept as they were
    packed: int = 0
    kept: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)
    exact: dict[str, int] = field(default_factory=dict)
    small_bytes: int = 0

    @property
    def ratio(self) -> float:
        return self.saved_bytes / self.kept_bytes if self.kept_bytes else 1.0

    def describe_exact(self) -> str:
        """``"kept exact: 80.0 MiB (scaled_dot_product_attention q/k 64.0 MiB, ...)"``."""
        small = {"small tensors": self.small_bytes} if self.small_bytes else {}
        return describe_exact({**self.exact, **small})


def storage_key(t: torch.Tensor, bits: object, bumps: int = 0) -> tuple:
    """The key of ``t``'s value at ``bits``: the storage's address (what
    ``StorageWeakRef(...).cdata`` holds, without a weak reference), the view, and the version
    (``bumps``: increments still to come before backward, as ``mark_dirty``'s)."""
    return (t.untyped_storage()._cdata, t.storage_offset(), tuple(t.shape), t.stride(),
            t.dtype, t._version + bumps, bits)


class Accounting:
    """Counts what autograd would keep and what the session keeps instead. Only a statistics
    ``sink`` or an allocator on its statistics step (whose budget counts a slot shared by
    two saved tensors twice, once per storage) reads the counts: without either,
    :attr:`counting` is False and the session skips them (most of the hooks' work on a tensor
    kept as it is; an allocated step between statistics steps counts nothing)."""

    def __init__(self) -> None:
        self.stats = CompressionStats()
        self.sink: Callable[[CompressionStats], None] | None = None
        self.budgeted = False  # an allocator on its statistics step is attached
        self.counting = False  # sink or budgeted (kept up to date by the setters below)
        self.seen: dict[tuple, StorageWeakRef] = {}
        self.seen_limit = tunables.SEEN_LIMIT  # entries before the dead ones are dropped

    def set_sink(self, sink: Callable[[CompressionStats], None] | None) -> None:
        self.sink = sink
        self.counting = sink is not None or self.budgeted

    def set_budgeted(self, budgeted: bool) -> None:
        self.budgeted = budgeted
        self.counting = self.sink is not None or budgeted

    def count(self, t: torch.Tensor) -> bool:
        """Count ``t`` as an activation autograd would keep; False if its storage was already
        counted in this context (always True when nothing reads the counts)."""
        if not self.counting:
            return True
        key = storage_key(t, None)[:-2]  # (without version and bits: the view, any value)
        seen = self.seen.get(key)
        if seen is not None and not seen.expired():
            return False
        self.seen[key] = StorageWeakRef(t.untyped_storage())
        if len(self.seen) > self.seen_limit:  # (a loop inside one context: forget the dead)
            self.seen = {k: v for k, v in self.seen.items() if not v.expired()}
            self.seen_limit = max(tunables.SEEN_LIMIT, 2 * len(self.seen))
        self.stats.saved_bytes += t.numel() * t.element_size()
        return True

    def count_internal(self, nbytes: int) -> None:
        """Count ``nbytes`` an op of PyTorch's would keep in a tensor it makes inside itself
        and no caller sees (CTC's forward variables), where a rule keeps something else."""
        if self.counting:
            self.stats.saved_bytes += nbytes

    def forget(self, t: torch.Tensor) -> None:
        """``t``'s storage holds a new value (written over in place): count it again."""
        self.seen.pop(storage_key(t, None)[:-2], None)

    def kept_exact(self, t: torch.Tensor, new: bool, label: str, small: bool) -> None:
        """Account ``t``, kept as it is, under ``label`` (``small``: under the level's
        ``min_numel``, counted apart). ``new``: its storage was not counted before."""
        if new and self.sink is not None:
            nbytes = t.numel() * t.element_size()
            stats = self.stats
            stats.kept += 1
            stats.kept_bytes += nbytes
            stats.by_kind["exact"] = stats.by_kind.get("exact", 0) + nbytes
            if small:
                stats.small_bytes += nbytes
            else:
                stats.exact[label] = stats.exact.get(label, 0) + nbytes

    def compiled_save(self, t: torch.Tensor, new: bool, group_size: int) -> bool:
        """Account ``t``, saved outside any op, as a compiled graph's packed codes (the
        elements they stand for, as float32, in ``saved_bytes``) or their groups' statistics
        (held, not an activation), if its shape says so (:func:`actune.traced.packed_origin`;
        docs/training.md, "torch.compile"). Kept as it is either way."""
        origin = packed_origin(t, group_size)
        if origin is None and not group_statistic(t):
            return False
        if new:
            stats, nbytes = self.stats, t.numel() * t.element_size()
            stats.saved_bytes += origin[0] * 4 - nbytes if origin else -nbytes
            stats.kept_bytes += nbytes
            stats.packed += origin is not None
            stats.by_kind["compiled"] = stats.by_kind.get("compiled", 0) + nbytes
        return True

    def held(self, nbytes: int, kind: str, replaces: tuple = ()) -> None:
        """Account a packed value of ``nbytes`` as kept, and the tensors it ``replaces`` as
        what PyTorch kept."""
        if not self.counting:
            return
        for r in replaces:
            self.count(r)
        stats = self.stats
        stats.packed += 1
        stats.kept_bytes += nbytes
        stats.by_kind[kind] = stats.by_kind.get(kind, 0) + nbytes

    def drawn_again(self, kind: str, replaces: tuple = ()) -> None:
        """Account tensors that backward draws again from a seed: PyTorch kept ``replaces``,
        the session keeps nothing."""
        if not self.counting:
            return
        for r in replaces:
            self.count(r)
        self.stats.by_kind.setdefault(kind, 0)

    def close(self) -> None:
        """Hand the context's statistics to the sink (if any) and start afresh."""
        sink = self.sink
        self.set_sink(None)
        if sink is not None:
            sink(self.stats)
        self.stats = CompressionStats()
