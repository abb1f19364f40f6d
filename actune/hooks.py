"""compressed(level): compress what autograd saves, for any architecture.

Inside ``with actune.compressed("L3"):`` two public PyTorch mechanisms work together:

* ``torch.autograd.graph.saved_tensors_hooks`` packs every tensor autograd saves and unpacks it
  when backward needs it. The unpacked (dequantized) tensor lives only while its backward node
  runs; the packed form is the only copy kept between forward and backward.
* a ``TorchFunctionMode`` (:mod:`actune.mode`) sees each functional call (modules call them
  too) and looks it up in the rule registry (:mod:`actune.rules`), so the pack hook knows which
  op is saving a tensor and how that op's backward uses it: rounded where the backward is
  linear in it (unbiased), replaced by a rounded derivative, an exact mask or index, or kept
  exact. An op without a rule keeps what it saves exact, and :class:`CompressionStats` names
  it with its bytes.

Parameters (and their autocast copies) stay references; a storage saved by several ops is
packed once; boolean masks take 1 bit; tensors with fewer than ``level.min_numel`` elements are
kept. The inputs that ``torch.utils.checkpoint`` keeps for recomputation (a checkpointed
region's boundary) are packed at the level's ``nonlinear_bits``; inside the region
checkpointing's own hooks save, and what its recomputation saves is packed as
:mod:`actune.recompute` says. Double backward (``create_graph=True``)
raises: the saved values are not differentiable.

This module holds the session (levels, the packed-storage cache, the statistics); the functions
that stand in for ops are in :mod:`actune.substitutes` and the rule modules, and what is kept
for one saved tensor (device or host, and how it comes back) in :mod:`actune.saved`.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.weak import WeakIdKeyDictionary

from actune.autoprec import AutoPrecision, Plan
from actune.fused import fused_modules
from actune.levels import Level, get_level
from actune.mode import FunctionMode, parameter_like, top_hooks
from actune.quant import (
    PackedMask,
    _draw_seed,
    pack_mask,
    quantize_checked,
    quantize_samples,
)
from actune.quant_batch import quantize_many
from actune.recompute import (
    REENTRANT,
    checkpoint_saver,
    checkpoint_saving,
    compress_recomputation,
    compress_reentrant,
)
from actune.rules import op_name
from actune.saved import Derived, Saved, feature_major, row_statistic
from actune.traced.pack import group_statistic, packed_origin

__all__ = ["CompressionStats", "active_level", "allow_overwrite", "compressed", "feature_major",
           "shared_cache"]


# Which ops' saved tensors are quantized, and with which of the level's bit widths.
_MATMUL = "matmul"
_OTHER = "other"
_ZEROS = "zeros"  # a tensor >= 0 whose backward reads its exact zeros (rules/masks.py)
_ALLOCATED = "allocated"  # cache-key marker: bits chosen by the allocator
_OUTSIDE = "(saved outside any op)"  # a custom autograd function's ctx.save_for_backward
_BOUNDARY = "checkpoint boundary"
_SEEN_LIMIT = 4096


def _NO_REF() -> None:  # noqa: N802 - a dead weak reference's stand-in
    return None


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


def _zero_code_bits(level: Level) -> int | None:
    bits = level.matmul_bits or level.other_bits
    return bits if level.masks and bits is not None and bits >= 2 else None


#: Rule bits -> the level's width for them.
_WIDTHS: dict[str, Callable[[Level], int | None]] = {
    _MATMUL: lambda level: level.matmul_bits,
    _OTHER: lambda level: level.other_bits,
    _ZEROS: _zero_code_bits,
}


def _storage_key(t: torch.Tensor, bits: object, bumps: int = 0) -> tuple:
    """The packed-storage cache's key of ``t``'s value at ``bits``: the storage's address (what
    ``StorageWeakRef(...).cdata`` holds, without a weak reference), the view, and the version
    (``bumps``: increments still to come before backward, as ``mark_dirty``'s)."""
    return (t.untyped_storage()._cdata, t.storage_offset(), tuple(t.shape), t.stride(),
            t.dtype, t._version + bumps, bits)


def _whole_key(t: torch.Tensor) -> tuple:
    """What every contiguous view of all of ``t`` shares: storage, offset, size, dtype."""
    return (t.untyped_storage()._cdata, t.storage_offset(), t.numel(), t.dtype)


class _Session:
    """The per-thread state of nested compressed() contexts: the level stack, the op being
    run, and the packed-storage cache that makes a storage saved by several ops pack once."""

    def __init__(self) -> None:
        self.levels: list[Level] = []
        self.level: Level | None = None  # the innermost level (levels[-1]), None outside
        self.widths: dict[str | None, int | None] = {None: None}  # see _set_level
        self.holds = 0  # forward passes of compress()ed models that share one cache
        self.kind: str | None = None  # the level's bit width the running op's rule names
        self.op = None  # the function being run (None: outside any routed call)
        self.hook = self.pack_hook  # the object registered as the pack hook (who saves?)
        self.cache: dict[tuple, object] = {}
        self.seed: int | None = None  # the next tensor's seed (drawn at the first, see _seeds)
        self.seen: dict[tuple, StorageWeakRef] = {}
        self.seen_limit = _SEEN_LIMIT  # entries before the dead ones are dropped
        # tensors a later saver rebuilds from another's packed value (a layer norm's output
        # from its normalised input): storage key without shape -> (alive, version, Derived)
        self.derived: dict[tuple, list] = {}
        self.last_offloaded: Saved | None = None
        self.stats = CompressionStats()
        self.autoprec: AutoPrecision | None = None
        self.touched: list[int] | None = None  # allocator slots read by the op being run
        self.only_shape: torch.Size | None = None  # a norm: only tensors of its input's shape
        self.features = False  # the running op saves features-last tensors (feature_major)
        # the ids of a norm's other arguments (its buffers): references
        self.references: set[int] | tuple = ()
        # the ids of what the running op keeps exact on purpose (a broadcast operand)
        self.exact_ids: set[int] | tuple = ()
        self.last_matmul = None  # statistics steps: the last matmul call (output, func, args)
        # tensors a batch norm may write its result over, once (allow_overwrite)
        self.overwritable = WeakIdKeyDictionary()
        self._exit: contextlib.ExitStack | None = None
        # the level of a reentrant checkpoint whose forward ran in this pass (see
        # reentrant_outputs): its backward node is found among later ops' arguments
        self.reentrant_level: Level | None = None

    def fusing(self) -> bool:
        """Does this session compress what is saved now (a compressing level, and its hooks
        the ones saving, not checkpointing's or save_on_cpu's)?"""
        top = top_hooks(False)
        return (self.level is not None and not self.level.exact and top is not None
                and top[0] is self.hook)

    def attach(self, autoprec: AutoPrecision | None) -> AutoPrecision | None:
        """Make ``autoprec`` (if given) the allocator of the block being entered, which is one
        step of it when gradients are recorded; returns the allocator to restore on exit."""
        previous = self.autoprec
        if autoprec is not None:
            self.autoprec = autoprec
            if torch.is_grad_enabled():
                autoprec.begin_step()
        return previous

    def allocator(self) -> AutoPrecision | None:
        """The allocator choosing bits now (a level with ``avg_bits`` and one attached)."""
        ap = self.autoprec
        level = self.level
        return ap if ap is not None and level is not None and level.avg_bits is not None else None

    # -- hooks ---------------------------------------------------------------------------

    def pack_hook(self, t: torch.Tensor) -> object:
        level = self.level
        n = t.numel()
        counting = self.stats_sink is not None or self.autoprec is not None
        if not counting and n < level.min_numel:
            return t  # kept as it is, and nothing counts it (most calls: statistics, buffers)
        if parameter_like(t) or id(t) in self.references:
            return t  # a parameter or a buffer (running statistics): costs nothing
        new = self.count(t) if counting else True
        if self.op is None and self.stats_sink is not None and self._compiled_save(t, new):
            return t  # what a compiled graph packed (see _compiled_save)
        if self.exact_ids and id(t) in self.exact_ids:
            return self._keep(t, new, f"{op_name(self.op)} broadcast operand")
        if t.dtype == torch.bool:
            if level.masks and n >= level.min_numel:
                return self._pack(t, None, "mask", lambda: pack_mask(t))
            return self._keep(t, new)
        bits = self.widths[self.kind]  # the level's bits for what this op saves (None: exact)
        if self.derived and self.kind == _MATMUL and self.features and bits is not None:
            # a matmul with a weight: its backward reads this input for the weight's gradient
            # alone, so sharing the norm's rounding adds no product of one noise with itself
            derived = self._derived(t, bits, new)
            if derived is not None:
                return derived
        saver = checkpoint_saver() if bits is None and self.op is None else None
        if saver is not None:
            self._compress_recomputation(saver, t)
            bits = level.boundary_width  # the region is recomputed from these: nonlinear
            if bits is not None and t.is_floating_point() and n >= level.min_numel:
                return self._pack(t, bits, _BOUNDARY)
            return self._keep(t, new, _BOUNDARY)
        if bits is None or not t.is_floating_point() or n < level.min_numel:
            return self._keep(t, new)
        if self.kind != _MATMUL and row_statistic(t):  # (a matmul's input of width 1: rank 1)
            return self._keep(t, new, None if self.op is None
                              else f"{op_name(self.op)} row statistic")
        if self.only_shape is not None and t.shape != self.only_shape:
            return self._keep(t, new)  # a norm's own statistics (mean, rstd): kept exact
        ap = None if self.autoprec is None else self.allocator()
        by_feature = self.features and not (ap is not None and ap.splits_samples(t))
        if ap is not None:
            return self._pack_allocated(t, self.kind, by_feature)
        zeros = self.kind == _ZEROS  # (accounted as PackedReLU's are)
        return self._pack(t, bits, "relu" if zeros else self.kind, by_feature=by_feature,
                          zero_code=zeros)

    def _compress_recomputation(self, saver: object, t: torch.Tensor) -> None:
        """A checkpointed region saves its input ``t``: compress what its recomputation
        saves too, at this level's uniform widths (:mod:`actune.recompute`)."""
        level = self.level
        if level.exact:
            return
        # what the recomputation saves is held for one region only: at the level's sensitive
        # width it costs little and adds less noise than the level's own rules
        # (docs/training.md, "Checkpointed regions"); read soon after, so never offloaded
        wide = level.sensitive_width
        widths = {} if wide is None else {
            "matmul_bits": level.matmul_bits and max(level.matmul_bits, wide),
            "other_bits": max(level.other_bits, wide)}
        level = level.with_(offload=False, defrag=False, avg_bits=None, **widths)
        if saver is not REENTRANT:
            recomputing = _Session()
            recomputing._set_level(level)
            compress_recomputation(saver, recomputing)
            return
        self.reentrant_level = level  # its backward node is made after: see reentrant_outputs
        self.reentrant_outputs((t,))  # (the region before, if its output is this input)

    def reentrant_outputs(self, tensors) -> None:
        """Compress the recomputation of the reentrant checkpoints whose outputs are among
        ``tensors`` (the arguments of an op after a reentrant region's forward)."""
        level = self.reentrant_level
        for t in tensors:
            fn = t.grad_fn if isinstance(t, torch.Tensor) else None
            if fn is not None and type(fn).__name__ == "CheckpointFunctionBackward":
                compress_reentrant(fn, lambda: compressed(level))

    @staticmethod
    def unpack_hook(saved: object) -> torch.Tensor:
        cls = type(saved)  # (cheaper than isinstance on this path, taken for every tensor)
        return saved.get() if cls is Saved or cls is Derived else saved

    # -- tensors rebuilt from another's packed value ---------------------------------------

    def derive(self, t: torch.Tensor, base: Saved, weight: torch.Tensor | None,
               bias: torch.Tensor | None, factor: Saved | None = None) -> None:
        """Later savers of ``t`` (or of a view of all of it) keep nothing of their own: they
        rebuild it as ``base * weight + bias`` from ``base``, packed already (a layer norm's
        output from its normalised input, whose rounding then serves both backwards), or as
        ``base * factor`` (a gated product's output from its two packed operands)."""
        if t.is_contiguous():  # (held weakly, as the cache's values are: see _remember)
            for saved in (base, factor):  # (its maker's backward reads it: one reader)
                if saved is not None:
                    saved.readers = max(saved.readers, 1)
            key = _whole_key(t)
            drop = _dropper(self.derived, key, 2)
            self.derived[key] = [StorageWeakRef(t.untyped_storage()), t._version,
                                 weakref.ref(base, drop), weight, bias,
                                 None if factor is None else weakref.ref(factor, drop),
                                 _NO_REF]

    def _derived(self, t: torch.Tensor, bits: int, new: bool) -> Derived | None:
        """``t`` as a :class:`Derived` if it is a tensor :meth:`derive` named, unchanged since,
        and its base was packed at ``bits`` or more (or by the allocator), else None. ``new``:
        ``t``'s storage was not counted before in this context."""
        if not t.is_contiguous():
            return None
        entry = self.derived.get(_whole_key(t))
        if entry is None or entry[0].expired() or entry[1] != t._version:
            return None
        base_ref, weight, bias, factor_ref = entry[2:6]
        base, factor = base_ref(), factor_ref and factor_ref()
        if base is None or (factor_ref is not None and factor is None):
            return None
        shared = entry[6]()  # one Derived for the savers of one view: rebuilt once
        if (shared is not None and shared.shape == t.shape and shared.base is base
                and shared.factor is factor):
            derived = shared
        else:
            derived = Derived(base, weight, bias, t.shape, factor)  # (as this saver views it)
        ap = self.allocator()
        if base.slot is None and ((ap is not None and factor is None)
                                  or (derived.bits or 0) < bits):
            return None  # (a product's operands keep fixed bits, under an allocator too)
        entry[6] = weakref.ref(derived)
        derived.add_reader()
        if base.slot is not None and ap is not None:
            if new:
                ap.share(base.slot)  # the slot stands for two saved tensors in the budget
            self._touch(base.slot, derived.noise_scale() if ap.collecting else None)
        return derived

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

    def run_as(self, kind: str, func, args, kwargs):
        """Run ``func`` with its saved tensors packed at the level's ``kind`` bits."""
        previous, self.kind = self.kind, kind
        try:
            return func(*args, **kwargs)
        finally:
            self.kind = previous

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
            floor = 2 if kind == _OTHER and self.only_shape is None else 1
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
                   by_feature: bool = False) -> Saved:
        """Pack ``t`` at ``bits`` whatever the allocator would choose (tensors whose bits the
        level sets apart: attention's q and k, the loss's probabilities); ``by_feature``: each
        group one feature's values (:mod:`actune.quant_columns`)."""
        packed = self._quantize(t, bits, by_feature=by_feature)
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

    def pack_bool(self, mask: torch.Tensor, kind: str, replaces: tuple = ()) -> Saved:
        return self._hold(self._new(pack_mask(mask)), kind, replaces)

    # -- entering and leaving ------------------------------------------------------------

    def clear(self) -> None:
        """Let go of the packed-storage cache (a forward pass has ended)."""
        self.cache.clear()
        self.seen.clear()
        self.seed = None
        self.derived.clear()
        self.last_offloaded = None
        self.reentrant_level = None

    def push(self, level: Level) -> None:
        if not self.levels:
            self._exit = contextlib.ExitStack()
            self._exit.enter_context(
                torch.autograd.graph.saved_tensors_hooks(self.hook, self.unpack_hook))
            self._exit.enter_context(FunctionMode(self))
            # inline RMSNorm, tanh GELU: one op, where this session compresses (not at an
            # exact level, not in a checkpointed region, whose recomputation runs the
            # module's own code)
            self._exit.enter_context(fused_modules(self.fusing))
        self.levels.append(level)
        self._set_level(level)

    def _set_level(self, level: Level | None) -> None:
        self.level = level
        # each rule-bits kind's width at this level, computed once (None: kept exact)
        self.widths = {None: None, **({} if level is None else {
            kind: width(level) for kind, width in _WIDTHS.items()})}

    def pop(self) -> None:
        self.levels.pop()
        self._set_level(self.levels[-1] if self.levels else None)
        if not self.levels:
            exit_stack, self._exit = self._exit, None
            if not self.holds:
                self.clear()
            exit_stack.close()
            sink, self.stats_sink = self.stats_sink, None
            if sink is not None:
                sink(self.stats)
            self.stats = CompressionStats()

    stats_sink: Callable[[CompressionStats], None] | None = None


_local = threading.local()


def _session() -> _Session:
    s = getattr(_local, "session", None)
    if s is None:
        s = _local.session = _Session()
    return s


def active_level() -> Level | None:
    """The level of this thread's innermost open :func:`compressed` block (None outside)."""
    s = getattr(_local, "session", None)
    return s.levels[-1] if s is not None and s.levels else None


def allow_overwrite(t: torch.Tensor) -> torch.Tensor:
    """Let a training-mode batch norm under :func:`compressed` write its result over ``t``
    (it packs ``t`` first): for a tensor nothing else reads, such as a convolution's output
    whose only reader is that batch norm (:func:`actune.inplace.allow_inplace_norms` finds
    those). Returns ``t``."""
    _session().overwritable[t] = True
    return t


@contextlib.contextmanager
def shared_cache(autoprec: AutoPrecision | None = None) -> Iterator[None]:
    """Within this block, compressed() contexts that open and close (one per layer of a
    compress()ed model) share one packed-storage cache: a tensor saved by several layers (the
    input of q, k and v projections) is packed once. ``autoprec``: the allocator of the model
    whose forward pass this block is (one step of it)."""
    s = _session()
    s.holds += 1
    previous = s.attach(autoprec)
    try:
        yield
    finally:
        s.autoprec = previous
        s.holds -= 1
        if not s.holds and not s.levels:
            s.clear()


@contextlib.contextmanager
def compressed(level: str | Level = "L3",
               stats: Callable[[CompressionStats], None] | None = None,
               autoprec: AutoPrecision | None = None) -> Iterator[Level]:
    """Compress the activations autograd saves for backward, for any model.

    ``with actune.compressed("L3"): loss = model(x)`` then ``loss.backward()`` (inside or
    outside the block). Contexts nest; the innermost level applies. ``stats``, if given, is
    called with the :class:`CompressionStats` when the outermost context exits. With a level
    that has ``avg_bits`` (L3-L5, ``"2b"``, ``"1.25b"``), ``autoprec`` allocates the bits: each
    block is one step of it. Without one such a level packs every tensor at its uniform bits.
    """
    lv = get_level(level)
    s = _session()
    if (lv.exact and stats is None) or checkpoint_saving():
        # L0: plain PyTorch, not even the hooks; in a checkpointed region (its forward or its
        # recomputation) checkpointing saves, and a compressed layer there runs as it is
        yield lv
        return
    outer = not s.levels
    if outer:
        s.stats_sink = stats
    previous = s.attach(autoprec)
    s.push(lv)
    try:
        yield lv
    finally:
        s.pop()
        s.autoprec = previous
        if lv.defrag and torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()
