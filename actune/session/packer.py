"""The session's packing: each saved tensor quantized at its level's width, or as its
allocator plans, found in the packed-storage cache if another op packed the same value, and
accounted. Substituted functions (:mod:`actune.rules`) pack through it too."""

from __future__ import annotations

from collections.abc import Callable

import torch

from actune.autoprec.allocator import Plan
from actune.packing.batch import quantize_many
from actune.packing.columns import feature_major
from actune.packing.formats import PackedCodes, PackedMask, PackedTensor
from actune.packing.kernels import draw_seed
from actune.packing.masks import pack_mask
from actune.packing.samples import quantize_samples
from actune.packing.saved import Saved
from actune.packing.tensors import quantize_checked
from actune.session.accounting import Accounting, storage_key
from actune.session.packed_cache import PackedCache

__all__ = ["OTHER", "Packer"]

OTHER = "other"  # the level's width for elementwise ops' operands (see actune.session.hooks)
_ALLOCATED = "allocated"  # cache-key marker: bits chosen by the allocator
#: what a substitute packs that takes 2 bits at least from the allocator: a derivative (at one
#: bit it keeps only its group's ends), softmax's copies (read as a product of the two in
#: backward) and a layer norm's normalised input (read times itself): one bit's noise in each,
#: multiplied (docs/autoprec.md)
_TWO_BITS_AT_LEAST = frozenset({"derivative", "softmax", "norm"})


class Packer:
    """Packs for one session: reads the session's ``level`` (the innermost level),
    label's ``only_shape`` (a norm: only tensors of its input's shape are packed) and
    allocator, and
    accounts what it keeps in the session's :class:`Accounting`."""

    def __init__(self, session, accounting: Accounting, cache: PackedCache) -> None:
        self.session = session
        self.accounting = accounting
        self.cache = cache
        self.seed: int | None = None  # the next tensor's seed (drawn at the first, see _seeds)
        self.last_offloaded: Saved | None = None
        self.touched: list | None = None  # allocator slots read by the op being run

    def clear(self) -> None:
        self.seed = None
        self.last_offloaded = None

    def _new(self, packed) -> Saved:
        """A saved value; offloaded ones are chained in packing order for prefetching."""
        if not self.session.level.offload:
            return Saved(packed, False)
        saved = Saved(packed, True, self.last_offloaded)
        if saved.ready is not None:
            self.last_offloaded = saved
        return saved

    def _hold(self, saved: Saved, kind: str, replaces: tuple = ()) -> Saved:
        """Account ``saved`` as kept (and the tensors it ``replaces`` as what PyTorch kept)."""
        if self.accounting.counting:
            self.accounting.held(saved.nbytes, kind, replaces)
        return saved

    def pack_allocated(self, t: torch.Tensor, kind: str, by_feature: bool = False,
                       uniform: int | None = None, features: bool = False) -> Saved:
        """Pack with the bits the allocator gives this slot (``by_feature``: each group one
        feature's values; ``uniform``: the level's width for it, until the allocator knows
        the slot; ``features``: a features-last input, grouped by feature wherever one width
        serves all its samples), or find it in the cache if the storage was packed already
        (this op reads that slot too)."""
        key = storage_key(t, _ALLOCATED)
        found = self.cache.find(key)
        if found is not None and isinstance(found.packed, PackedMask):
            found = None  # kept as a mask only (no reader at the last statistics step)
        if found is None:
            # an elementwise op's operand takes 2 bits at least, as a derivative does: at one
            # bit its noise is larger than the activation itself (a norm's input may take 1);
            # so does an operand of a product of two activations (attention's q k^T, p v),
            # whose backward multiplies its noise by the other operand's (docs/autoprec.md)
            label = self.session.label
            floor = 2 if (kind == OTHER and label.only_shape is None) or label.pair else 1
            packed, slot = self._quantize_planned(t, False, floor, by_feature, uniform,
                                                  features)
            found = self._hold(self._new(packed), kind)
            found.slot = slot
            self.cache.remember(key, t, found)
        found.readers += 1
        if self.touched is not None and found.slot is not None:  # (touch, inline)
            self.touched.append(found.slot)
        return found

    def _quantize_planned(self, t: torch.Tensor, zero_code: bool, floor: int = 1,
                          by_feature: bool = False, uniform: int | None = None,
                          features: bool = False) -> tuple[object, int]:
        """Pack ``t`` as the allocator plans its next slot (``by_feature``: each group one
        feature's values; per-sample widths from :func:`feature_major`'s copy); returns the
        packed form and slot."""
        ap = self.session.autoprec
        # (a 2-d tensor's groups by feature run down its rows, across the samples: one width)
        plan: Plan = ap.plan(t, zero_code, floor, split=not (by_feature and t.dim() == 2),
                             uniform=uniform)
        group = self.session.level.group_size
        if plan.bits == 0:
            return pack_mask(t > 0), plan.slot
        # a [batch, features] input split by sample keeps its rows whole for per-sample
        # widths; where one width serves every sample (a statistics step, a slot whose
        # samples share one) it is grouped by feature, as uniform widths group it: groups
        # along a row span features of other scales (wav2vec 2.0's mean-pooled features:
        # its statistics step's gradient 20x noisier), and the allocator reads the rows'
        # noise from their ranges instead
        rows = features and not by_feature and not plan.by_rank and plan.samples > 1 and (
            t.dim() == 2)
        if plan.by_rank:
            packed = quantize_samples(feature_major(t) if by_feature else t, plan.by_rank,
                                      group_size=group, zero_code=zero_code, weight=plan.weight)
        else:
            packed = self._quantize(t, plan.bits, zero_code, by_feature or rows)
        if plan.collect:
            ap.observe(plan, packed, t, group if rows else None)
        return packed, plan.slot

    def _seeds(self, n: int = 1) -> int:
        """The first of ``n`` seeds for the tensors packed next: one draw from torch's
        generator per context (``torch.manual_seed`` still makes a run repeatable), then
        consecutive seeds, as :func:`~actune.packing.batch.quantize_many` gives its calls."""
        if self.seed is None:
            self.seed = draw_seed()
        first = self.seed
        self.seed = first + n
        return first

    def _quantize(self, t: torch.Tensor, bits: int, zero_code: bool = False,
                  by_feature: bool = False):
        """:func:`~actune.packing.tensors.quantize` at the level's group size, seeded by
        :meth:`_seeds` (a fake tensor draws nothing: its values do not exist); ``by_feature``:
        each group one feature's values (:mod:`actune.packing.columns`)."""
        return quantize_checked(t, bits, self.session.level.group_size,
                                self._seeds() if type(t) is torch.Tensor else -1,
                                zero_code=zero_code, by_feature=by_feature)

    def touch(self, slot: int | None, scale: torch.Tensor | None = None) -> None:
        """The running op reads ``slot`` (``scale``: its noise there, relative to the slot's)."""
        if self.touched is not None and slot is not None:
            self.touched.append(slot if scale is None else (slot, scale))

    def pack(self, t: torch.Tensor, bits: int | None, kind: str, make: Callable | None = None,
              by_feature: bool = False, zero_code: bool = False) -> Saved:
        """``t`` packed (by ``make()``, else quantized at ``bits``, in feature-major order with
        ``by_feature``), or what a saver of the same value packed before. (No
        closure on the quantizing path: it runs for every compressed tensor.)"""
        key = storage_key(t, bits)
        found = self.cache.find(key)
        if found is not None:
            found.readers += 1
            return found
        packed = make() if make is not None else self._quantize(t, bits, zero_code, by_feature)
        saved = self._new(packed)
        saved.readers = 1
        self.cache.remember(key, t, saved)
        return self._hold(saved, kind)

    # -- packing for the substituted functions (not through the hooks) ---------------------

    def pack_value(self, t: torch.Tensor, bits: int, kind: str, replaces: tuple = (),
                   share_as: torch.Tensor | None = None, zero_code: bool = False,
                   dirty: bool = False, reads: bool = True, by_feature: bool = False) -> Saved:
        """Pack ``t`` in place of the tensors ``replaces`` that PyTorch's op would save; with
        ``share_as``, later savers of that tensor reuse this packed copy (``dirty``: the
        function marks it dirty, which bumps its version once more after forward). ``reads``:
        this op's backward reads the rounded values (not only its exact zeros). ``by_feature``:
        each group one feature's values (:mod:`actune.packing.columns`)."""
        if self.session.allocating is not None:
            packed, slot = self._quantize_planned(t, zero_code,
                                                  2 if kind in _TWO_BITS_AT_LEAST else 1,
                                                  by_feature, bits)
            saved = self._hold(self._new(packed), kind, replaces)
            saved.slot = slot
            if reads:
                self.touch(saved.slot)
            if share_as is not None:
                saved.readers = 1  # (the substitute's backward; savers that share it add theirs)
                self.cache.remember(storage_key(share_as, _ALLOCATED, int(dirty)), share_as, saved)
            return saved
        packed = self._quantize(t, bits, zero_code, by_feature)
        saved = self._hold(self._new(packed), kind, replaces)
        if share_as is not None:
            saved.readers = 1
            self.cache.remember(storage_key(share_as, bits, int(dirty)), share_as, saved)
        return saved

    def pack_fixed(self, t: torch.Tensor, bits: int, kind: str, replaces: tuple = (),
                   by_feature: bool = False,
                   observe: Callable[[PackedTensor], None] | None = None) -> Saved:
        """Pack ``t`` at ``bits`` whatever the allocator would choose (tensors whose bits the
        level sets apart: attention's q and k, the loss's probabilities); ``by_feature``: each
        group one feature's values (:mod:`actune.packing.columns`). ``observe`` is handed the
        packed value where it was made, before any offload moves it to the host (a statistic
        of it computed there stays on the device, with no wait for the copy)."""
        packed = self._quantize(t, bits, by_feature=by_feature)
        if observe is not None:
            observe(packed)
        return self._hold(self._new(packed), kind, replaces)

    def pack_fixed_many(self, items: list[tuple[torch.Tensor, int, str]]) -> list[Saved]:
        """:meth:`pack_fixed` of several tensors one op saves, ``(tensor, bits, kind)`` each:
        the small ones in one kernel call (:func:`actune.packing.batch.quantize_many`)."""
        packed = quantize_many([t for t, _, _ in items], [b for _, b, _ in items],
                               group_size=self.session.level.group_size,
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
        self.accounting.drawn_again(kind, replaces)

    def keep_exact(self, t: torch.Tensor, label: str) -> torch.Tensor:
        """Keep ``t`` exact on purpose (a substituted function's choice), named ``label``."""
        self.session.keep(t, self.accounting.count(t), label)
        return t

    def pack_codes(self, packed: PackedCodes, kind: str, replaces: tuple = ()) -> Saved:
        """Codes packed already (a codebook's: :meth:`actune.packing.codebooks.Codebook.pack`), kept
        as they are, outside the allocator's budget."""
        return self._hold(self._new(packed), kind, replaces)

    def pack_bool(self, mask: torch.Tensor, kind: str, replaces: tuple = ()) -> Saved:
        return self._hold(self._new(pack_mask(mask)), kind, replaces)
