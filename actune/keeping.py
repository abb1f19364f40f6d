"""What a :func:`actune.compressed` session keeps for each saved tensor, and its accounting.

:class:`Keeper` is the part of the session (:mod:`actune.hooks`) that packs: at the level's
bits or at the bits the allocator plans (:mod:`actune.autoprec`), through a packed-storage
cache so that a storage saved by several ops is packed once, and for the substituted
functions that pack what they save themselves (:mod:`actune.substitutes`, the rules). It
counts what autograd would have kept and what is kept instead in :class:`CompressionStats`.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from actune.autoprec import AutoPrecision, Plan
from actune.levels import Level
from actune.quant import (
    PackedCodes,
    PackedMask,
    PackedTensor,
    _draw_seed,
    pack_mask,
    quantize_checked,
    quantize_samples,
)
from actune.quant_batch import quantize_many
from actune.rules import op_name
from actune.saved import Saved, feature_major
from actune.traced.pack import group_statistic, packed_origin

__all__ = ["CompressionStats", "Keeper"]

OTHER = "other"  # the level's width for elementwise ops' operands (see actune.hooks)
_ALLOCATED = "allocated"  # cache-key marker: bits chosen by the allocator
_OUTSIDE = "(saved outside any op)"  # a custom autograd function's ctx.save_for_backward
_SEEN_LIMIT = 4096


def _dropper(table: dict, key: tuple, at: int = 1) -> Callable[[weakref.ref], None]:
    """A weak reference's callback that removes ``table[key]`` if the entry still holds that
    reference at index ``at`` (not a later entry under the same key)."""
    def drop(ref: weakref.ref) -> None:
        entry = table.get(key)
        if entry is not None and entry[at] is ref:
            del table[key]
    return drop


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
        from actune.report import describe_exact

        small = {"small tensors": self.small_bytes} if self.small_bytes else {}
        return describe_exact({**self.exact, **small})


def _storage_key(t: torch.Tensor, bits: object, bumps: int = 0) -> tuple:
    """The packed-storage cache's key of ``t``'s value at ``bits``: the storage's address (what
    ``StorageWeakRef(...).cdata`` holds, without a weak reference), the view, and the version
    (``bumps``: increments still to come before backward, as ``mark_dirty``'s)."""
    return (t.untyped_storage()._cdata, t.storage_offset(), tuple(t.shape), t.stride(),
            t.dtype, t._version + bumps, bits)


class Keeper:
    """Packing, the packed-storage cache and the accounting of a session. The session sets
    ``level`` (the innermost level), ``op`` (the function being run, None outside any routed
    call) and ``only_shape`` (a norm: only tensors of its input's shape are packed)."""

    level: Level | None
    op: object
    only_shape: torch.Size | None
    stats_sink: Callable[[CompressionStats], None] | None = None

    def __init__(self) -> None:
        self.cache: dict[tuple, object] = {}
        self.seed: int | None = None  # the next tensor's seed (drawn at the first, see _seeds)
        self.seen: dict[tuple, StorageWeakRef] = {}
        self.seen_limit = _SEEN_LIMIT  # entries before the dead ones are dropped
        self.last_offloaded: Saved | None = None
        self.stats = CompressionStats()
        self.autoprec: AutoPrecision | None = None
        self.touched: list[int] | None = None  # allocator slots read by the op being run

    def allocator(self) -> AutoPrecision | None:
        """The allocator choosing bits now (a level with ``avg_bits`` and one attached)."""
        ap = self.autoprec
        level = self.level
        return ap if ap is not None and level is not None and level.avg_bits is not None else None

    # -- accounting: what autograd would keep (each storage once) and what is kept instead --

    def count(self, t: torch.Tensor) -> bool:
        """Count ``t`` as an activation autograd would keep; False if its storage was already
        counted in this context. Only a statistics sink or an allocator (whose budget counts a
        shared slot twice) reads the count: without one it is skipped (always True), as it is
        most of the hooks' work on a tensor kept as it is."""
        if self.stats_sink is None and self.autoprec is None:
            return True
        key = _storage_key(t, None)[:-2]  # (without version and bits: the view, any value)
        seen = self.seen.get(key)
        if seen is not None and not seen.expired():
            return False
        self.seen[key] = StorageWeakRef(t.untyped_storage())
        if len(self.seen) > self.seen_limit:  # (a loop inside one context: forget the dead)
            self.seen = {k: v for k, v in self.seen.items() if not v.expired()}
            self.seen_limit = max(_SEEN_LIMIT, 2 * len(self.seen))
        self.stats.saved_bytes += t.numel() * t.element_size()
        return True

    def _keep(self, t: torch.Tensor, new: bool, label: str | None = None) -> torch.Tensor:
        """Keep ``t`` as it is, accounted under the op saving it (or ``label``)."""
        if new and self.stats_sink is not None:
            nbytes = t.numel() * t.element_size()
            stats = self.stats
            stats.kept += 1
            stats.kept_bytes += nbytes
            stats.by_kind["exact"] = stats.by_kind.get("exact", 0) + nbytes
            if t.numel() < self.level.min_numel:
                stats.small_bytes += nbytes
            else:
                if label is None:
                    label = op_name(self.op) if self.op is not None else _OUTSIDE
                stats.exact[label] = stats.exact.get(label, 0) + nbytes
        return t

    def _compiled_save(self, t: torch.Tensor, new: bool) -> bool:
        """Account ``t``, saved outside any op, as a compiled graph's packed codes (the
        elements they stand for, as float32, in ``saved_bytes``) or their groups' statistics
        (held, not an activation), if its shape says so (:func:`actune.traced.packed_origin`;
        docs/training.md, "torch.compile"). Kept as it is either way."""
        origin = packed_origin(t, self.level.group_size)
        if origin is None and not group_statistic(t):
            return False
        if new:
            stats, nbytes = self.stats, t.numel() * t.element_size()
            stats.saved_bytes += origin[0] * 4 - nbytes if origin else -nbytes
            stats.kept_bytes += nbytes
            stats.packed += origin is not None
            stats.by_kind["compiled"] = stats.by_kind.get("compiled", 0) + nbytes
        return True

    def keep_exact(self, t: torch.Tensor, label: str) -> torch.Tensor:
        """Keep ``t`` exact on purpose (a substituted function's choice), named ``label``."""
        return self._keep(t, self.count(t), label)

    def forget(self, t: torch.Tensor) -> None:
        """``t``'s storage holds a new value (written over in place): count it again."""
        self.seen.pop(_storage_key(t, None)[:-2], None)

    def _new(self, packed) -> Saved:
        """A saved value; offloaded ones are chained in packing order for prefetching."""
        saved = Saved(packed, self.level.offload, self.last_offloaded)
        if saved.ready is not None:
            self.last_offloaded = saved
        return saved

    def _hold(self, saved: Saved, kind: str, replaces: tuple = ()) -> Saved:
        """Account ``saved`` as kept (and the tensors it ``replaces`` as what PyTorch kept)."""
        if self.stats_sink is None and self.autoprec is None:
            return saved
        for r in replaces:
            self.count(r)
        stats = self.stats
        stats.packed += 1
        stats.kept_bytes += saved.nbytes
        stats.by_kind[kind] = stats.by_kind.get(kind, 0) + saved.nbytes
        return saved

    # -- the packed-storage cache ----------------------------------------------------------

    def _cached(self, key: tuple) -> Saved | None:
        entry = self.cache.get(key)
        if entry is None:
            return None
        alive, saved = entry
        return None if alive() is None else saved()  # a freed storage's address can come back

    def _remember(self, key: tuple, t: torch.Tensor, saved: Saved) -> None:
        """Later savers of ``t`` (cache ``key``) share ``saved`` while ``t`` lives (which keeps
        the storage whose address the key holds alive: a plain weak reference, cheaper than
        one to the storage; a saver handed another tensor object of the same view, after ``t``
        is gone, packs its own copy) and something else holds ``saved``: the cache holds it
        weakly, so that backward frees each packed value once its readers have run (not at
        the end of the context: a loop inside one ``compressed()`` would keep every step's),
        and the entry goes with it."""
        self.cache[key] = (weakref.ref(t), weakref.ref(saved, _dropper(self.cache, key)))

    def _pack_allocated(self, t: torch.Tensor, kind: str, by_feature: bool = False) -> Saved:
        """Pack with the bits the allocator gives this slot (``by_feature``: each group one
        feature's values), or find it in the cache if the storage was packed
        already (this op reads that slot too)."""
        key = _storage_key(t, _ALLOCATED)
        found = self._cached(key)
        if found is not None and isinstance(found.packed, PackedMask):
            found = None  # kept as a mask only (no reader at the last statistics step)
        if found is None:
            # an elementwise op's operand takes 2 bits at least, as a derivative does: at one
            # bit its noise is larger than the activation itself (a norm's input may take 1)
            floor = 2 if kind == OTHER and self.only_shape is None else 1
            packed, slot = self._quantize_planned(t, False, floor, by_feature)
            found = self._hold(self._new(packed), kind)
            found.slot = slot
            self._remember(key, t, found)
        found.readers += 1
        self._touch(found.slot)
        return found

    def _quantize_planned(self, t: torch.Tensor, zero_code: bool, floor: int = 1,
                          by_feature: bool = False) -> tuple[object, int]:
        """Pack ``t`` as the allocator plans its next slot (``by_feature``: each group one
        feature's values; per-sample widths from :func:`feature_major`'s copy); returns the
        packed form and slot."""
        ap = self.autoprec
        plan: Plan = ap.plan(t, zero_code, floor)
        group = self.level.group_size
        if plan.bits == 0:
            return pack_mask(t > 0), plan.slot
        if plan.by_rank:
            packed = quantize_samples(feature_major(t) if by_feature else t, plan.by_rank,
                                      group_size=group, zero_code=zero_code, weight=plan.weight)
        else:
            packed = self._quantize(t, plan.bits, zero_code, by_feature)
        ap.observe(plan, packed, t)
        return packed, plan.slot

    def _seeds(self, n: int = 1) -> int:
        """The first of ``n`` seeds for the tensors packed next: one draw from torch's
        generator per context (``torch.manual_seed`` still makes a run repeatable), then
        consecutive seeds, as :func:`~actune.quant_batch.quantize_many` gives its calls."""
        if self.seed is None:
            self.seed = _draw_seed()
        first = self.seed
        self.seed = first + n
        return first

    def _quantize(self, t: torch.Tensor, bits: int, zero_code: bool = False,
                  by_feature: bool = False):
        """:func:`~actune.quant.quantize` at the level's group size, seeded by :meth:`_seeds`
        (a fake tensor draws nothing: its values do not exist); ``by_feature``: each group one
        feature's values (:mod:`actune.quant_columns`)."""
        return quantize_checked(t, bits, self.level.group_size,
                                self._seeds() if type(t) is torch.Tensor else -1,
                                zero_code=zero_code, by_feature=by_feature)

    def _touch(self, slot: int | None, scale: torch.Tensor | None = None) -> None:
        """The running op reads ``slot`` (``scale``: its noise there, relative to the slot's)."""
        if self.touched is not None and slot is not None:
            self.touched.append(slot if scale is None else (slot, scale))

    def _pack(self, t: torch.Tensor, bits: int | None, kind: str, make: Callable | None = None,
              by_feature: bool = False, zero_code: bool = False) -> Saved:
        """``t`` packed (by ``make()``, else quantized at ``bits``, in feature-major order with
        ``by_feature``), or what a saver of the same value packed before. (No
        closure on the quantizing path: it runs for every compressed tensor.)"""
        key = _storage_key(t, bits)
        found = self._cached(key)
        if found is not None:
            found.readers += 1
            return found
        packed = make() if make is not None else self._quantize(t, bits, zero_code, by_feature)
        saved = self._new(packed)
        saved.readers = 1
        self._remember(key, t, saved)
        return self._hold(saved, kind)

    # -- packing for the substituted functions (not through the hooks) ---------------------

    def pack_value(self, t: torch.Tensor, bits: int, kind: str, replaces: tuple = (),
                   share_as: torch.Tensor | None = None, zero_code: bool = False,
                   dirty: bool = False, reads: bool = True, by_feature: bool = False) -> Saved:
        """Pack ``t`` in place of the tensors ``replaces`` that PyTorch's op would save; with
        ``share_as``, later savers of that tensor reuse this packed copy (``dirty``: the
        function marks it dirty, which bumps its version once more after forward). ``reads``:
        this op's backward reads the rounded values (not only its exact zeros). ``by_feature``:
        each group one feature's values (:mod:`actune.quant_columns`)."""
        if self.allocator() is not None:
            # a derivative at one bit keeps only its group's ends: 2 at least
            packed, slot = self._quantize_planned(t, zero_code,
                                                  2 if kind == "derivative" else 1, by_feature)
            saved = self._hold(self._new(packed), kind, replaces)
            saved.slot = slot
            if reads:
                self._touch(saved.slot)
            if share_as is not None:
                saved.readers = 1  # (the substitute's backward; savers that share it add theirs)
                self._remember(_storage_key(share_as, _ALLOCATED, int(dirty)), share_as, saved)
            return saved
        packed = self._quantize(t, bits, zero_code, by_feature)
        saved = self._hold(self._new(packed), kind, replaces)
        if share_as is not None:
            saved.readers = 1
            self._remember(_storage_key(share_as, bits, int(dirty)), share_as, saved)
        return saved

    def pack_fixed(self, t: torch.Tensor, bits: int, kind: str, replaces: tuple = (),
                   by_feature: bool = False,
                   observe: Callable[[PackedTensor], None] | None = None) -> Saved:
        """Pack ``t`` at ``bits`` whatever the allocator would choose (tensors whose bits the
        level sets apart: attention's q and k, the loss's probabilities); ``by_feature``: each
        group one feature's values (:mod:`actune.quant_columns`). ``observe`` is handed the
        packed value where it was made, before any offload moves it to the host (a statistic
        of it computed there stays on the device, with no wait for the copy)."""
        packed = self._quantize(t, bits, by_feature=by_feature)
        if observe is not None:
            observe(packed)
        return self._hold(self._new(packed), kind, replaces)

    def pack_fixed_many(self, items: list[tuple[torch.Tensor, int, str]]) -> list[Saved]:
        """:meth:`pack_fixed` of several tensors one op saves, ``(tensor, bits, kind)`` each:
        the small ones in one kernel call (:func:`actune.quant_batch.quantize_many`)."""
        packed = quantize_many([t for t, _, _ in items], [b for _, b, _ in items],
                               group_size=self.level.group_size,
                               seed=self._seeds(len(items)) if all(
                                   type(t) is torch.Tensor for t, _, _ in items) else None)
        return [self._hold(self._new(p), kind, (t,))
                for p, (t, _, kind) in zip(packed, items, strict=True)]

    def pack_small_ints(self, values: torch.Tensor, kind: str, replaces: tuple = (),
                        dtype: torch.dtype = torch.uint8) -> Saved:
        """Integers kept exactly in ``dtype`` (one byte each by default: values in [0, 256))."""
        return self._hold(self._new(values.to(dtype)), kind, replaces)

    def draw_seed(self, like: torch.Tensor) -> int:
        """A seed for a random draw over ``like`` that backward repeats (a dropout mask drawn
        again); 0 for a fake tensor (an estimate: no values, nothing drawn)."""
        return self._seeds() if type(like) is torch.Tensor else 0

    def drawn_again(self, kind: str, replaces: tuple = ()) -> None:
        """Account tensors that backward draws again from a seed: PyTorch kept ``replaces``,
        this keeps nothing."""
        if self.stats_sink is None and self.autoprec is None:
            return
        for r in replaces:
            self.count(r)
        self.stats.by_kind.setdefault(kind, 0)

    def pack_codes(self, packed: PackedCodes, kind: str, replaces: tuple = ()) -> Saved:
        """Codes packed already (a codebook's: :meth:`actune.codebooks.Codebook.pack`), kept
        as they are, outside the allocator's budget."""
        return self._hold(self._new(packed), kind, replaces)

    def pack_bool(self, mask: torch.Tensor, kind: str, replaces: tuple = ()) -> Saved:
        return self._hold(self._new(pack_mask(mask)), kind, replaces)
