"""compressed(level): compress what autograd saves, for any architecture.

Inside ``with actune.compressed("L3"):`` two public PyTorch mechanisms work together:

* ``torch.autograd.graph.saved_tensors_hooks`` packs every tensor autograd saves and unpacks it
  when backward needs it. The unpacked (dequantized) tensor lives only while its backward node
  runs; the packed form is the only copy kept between forward and backward.
* a ``TorchFunctionMode`` (:mod:`actune.session.routing`) sees each functional call (modules call
them
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
:mod:`actune.session.recompute` says. Double backward (``create_graph=True``)
raises: the saved values are not differentiable.

This module holds the session (levels, the hooks, the op being run); its packing, its
packed-storage cache and its statistics are :mod:`actune.session.packer`,
:mod:`actune.session.packed_cache` and :mod:`actune.session.accounting`, the functions that stand
in for ops are in :mod:`actune.substitutes.functions` and the rule modules, and what is kept for one
saved tensor (device or host, and how it comes back) in :mod:`actune.packing.saved`.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.weak import WeakIdKeyDictionary

from actune.autoprec.allocator import AutoPrecision
from actune.levels import Level, get_level
from actune.packing.columns import feature_major
from actune.packing.masks import pack_mask
from actune.packing.saved import Derived, Saved, row_statistic
from actune.rules import op_name
from actune.session.accounting import OUTSIDE as _OUTSIDE
from actune.session.accounting import Accounting, CompressionStats
from actune.session.packed_cache import PackedCache, dropper
from actune.session.packer import OTHER as _OTHER
from actune.session.packer import Packer
from actune.session.recompute import (
    REENTRANT,
    checkpoint_saver,
    checkpoint_saving,
    compress_recomputation,
    compress_reentrant,
)
from actune.session.routing import (
    NARROW,
    ORDER_KEEPING_VIEWS,
    OUTSIDE_OPS,
    SENSITIVE,
    FunctionMode,
    OpLabel,
    parameter_like,
    top_hooks,
)
from actune.substitutes import lazy_logits
from actune.substitutes.fused import fused_modules

__all__ = ["CompressionStats", "active_level", "allow_overwrite", "compressed", "feature_major",
           "shared_cache"]


# Which ops' saved tensors are quantized, and with which of the level's bit widths.
_MATMUL = "matmul"
_ZEROS = "zeros"  # a tensor >= 0 whose backward reads its exact zeros (rules/masks.py)
_BOUNDARY = "checkpoint boundary"


def _NO_REF() -> None:  # noqa: N802 - a dead weak reference's stand-in
    return None


def _zero_code_bits(level: Level) -> int | None:
    bits = level.matmul_bits or level.other_bits
    return bits if level.masks and bits is not None and bits >= 2 else None


#: Rule bits whose width the bit allocator leaves as the level sets it.
_FIXED_WIDTHS = frozenset({NARROW, SENSITIVE})

#: Rule bits -> the level's width for them.
_WIDTHS: dict[str, Callable[[Level], int | None]] = {
    _MATMUL: lambda level: level.matmul_bits,
    NARROW: lambda level: level.narrow_width,
    _OTHER: lambda level: level.other_bits,
    SENSITIVE: lambda level: level.sensitive_width,
    _ZEROS: _zero_code_bits,
}


#: The dtypes autocast casts a matmul's input to (an fp32 tensor is nobody's such copy).
_CAST_DTYPES = frozenset({torch.bfloat16, torch.float16})


def _whole_key(t: torch.Tensor) -> tuple:
    """What every contiguous view of all of ``t`` shares: storage, offset, size, dtype."""
    return (t.untyped_storage()._cdata, t.storage_offset(), t.numel(), t.dtype)


class Session:
    """The per-thread state of nested compressed() contexts: the level stack, the op being
    run, the hooks. Its parts: :attr:`accounting` (what is counted and kept),
    :attr:`cache` (one packed copy per stored value) and :attr:`packer` (how a tensor is
    packed, for the hooks and the substituted functions alike)."""

    def __init__(self) -> None:
        self.accounting = Accounting()
        self.cache = PackedCache()
        self.packer = Packer(self, self.accounting, self.cache)
        self.autoprec: AutoPrecision | None = None
        self.allocating: AutoPrecision | None = None  # see _update_allocating
        self.levels: list[Level] = []
        self.level: Level | None = None  # the innermost level (levels[-1]), None outside
        self.widths: dict[str | None, int | None] = {None: None}  # see _set_level
        # (function, input shape, weight shape) -> (rule, label) of a linear layer or a
        # convolution with a trainable weight at ``level`` (see routing._label), kept while
        # the level is the same object
        self.weighted_labels: dict[tuple, tuple] = {}
        self._labelled_level: Level | None = None
        self.holds = 0  # forward passes of compress()ed models that share one cache
        # the op being run and what its rule says of what it saves (OUTSIDE_OPS: none)
        self.label: OpLabel = OUTSIDE_OPS
        self.hook = self.pack_hook  # the object registered as the pack hook (who saves?)
        # tensors a later saver rebuilds from another's packed value (a layer norm's output
        # from its normalised input): storage key without shape -> (alive, version, Derived)
        self.derived: dict[tuple, list] = {}
        self.last_matmul = None  # statistics steps: the last matmul call (output, func, args)
        # tensors a batch norm may write its result over, once (allow_overwrite)
        self.overwritable = WeakIdKeyDictionary()
        self._exit: contextlib.ExitStack | None = None
        # the level of a reentrant checkpoint whose forward ran in this pass (see
        # reentrant_outputs): its backward node is found among later ops' arguments
        self.reentrant_level: Level | None = None

    def compressing(self) -> bool:
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
            if torch.is_grad_enabled():
                autoprec.begin_step()
            self.set_allocator(autoprec)
        return previous

    def routing(self) -> FunctionMode:
        """A function mode routing each call through its rule for this session: a rule that
        computes its op as other calls (multi-head attention) sends them back through it."""
        return FunctionMode(self)

    def set_allocator(self, autoprec: AutoPrecision | None) -> None:
        self.autoprec = autoprec
        # (only a statistics step's budget reads which storages were seen: see _derived)
        self.accounting.set_budgeted(autoprec is not None and autoprec.collecting)
        self._update_allocating()

    def _update_allocating(self) -> None:
        """:attr:`allocating`: the allocator choosing bits now (a level with ``avg_bits`` and
        one attached), else None; kept up to date where either changes (read per call)."""
        ap, level = self.autoprec, self.level
        self.allocating = (ap if ap is not None and level is not None
                           and level.avg_bits is not None else None)

    def keep(self, t: torch.Tensor, new: bool, label: str | None = None) -> torch.Tensor:
        """Keep ``t`` as it is, accounted under the op saving it (or ``label``)."""
        if new and self.accounting.sink is not None:
            small = t.numel() < self.level.min_numel
            if label is None and not small:
                op = self.label.op
                label = op_name(op) if op is not None else _OUTSIDE
            self.accounting.kept_exact(t, new, label, small)
        return t

    # -- hooks ---------------------------------------------------------------------------

    def pack_hook(self, t: torch.Tensor) -> object:
        if t.requires_grad and t.is_leaf:
            return t  # a parameter, never counted (attribute reads: a third of what is saved)
        level = self.level
        n = t.numel()
        counting = self.accounting.counting
        if not counting and n < level.min_numel:
            return t  # kept as it is, and nothing counts it (most calls: statistics, buffers)
        op = self.label  # (read once: the op being run and its rule's say)
        if parameter_like(t) or id(t) in op.references:
            return t  # a parameter or a buffer (running statistics): costs nothing
        new = self.accounting.count(t) if counting else True
        if op.frozen_shapes and _copy_of_frozen(t, op.frozen_shapes):
            # autocast's copy of a frozen weight (a LoRA model's base, bf16-mixed): backward
            # reads it for the input's gradient alone, which rounding would make noisy below
            return self.keep(t, new, f"{op_name(op.op)} frozen weight (autocast copy)")
        if (op.op is None and self.accounting.sink is not None
                and self.accounting.compiled_save(t, new, level.group_size)):
            return t  # what a compiled graph packed (see _compiled_save)
        if op.exact_ids:
            # (or a view of it: a linear layer's backward reads its weight transposed)
            why = op.exact_ids.get(id(t))
            if why is None and t._base is not None:
                why = op.exact_ids.get(id(t._base))
            if why is not None:
                return self.keep(t, new, f"{op_name(op.op)} {why}")
        if t.dtype == torch.bool:
            # (a mask comes back contiguous: one saved outside any op in another layout, such
            # as a compiled graph's dropout mask of a transposed tensor, whose backward
            # asserts the layout it was saved in, is kept as it is)
            elsewhere = op.op is None and not t.is_contiguous()
            if level.masks and n >= level.min_numel and not elsewhere:
                return self.packer.pack(t, None, "mask", lambda: pack_mask(t))
            return self.keep(t, new, f"{_OUTSIDE}: a mask in another layout" if elsewhere
                              else None)
        kind = op.kind
        bits = self.widths[kind]  # the level's bits for what this op saves (None: exact)
        if self.derived and kind == _MATMUL and op.features and bits is not None:
            # a matmul with a weight: its backward reads this input for the weight's gradient
            # alone, so sharing the norm's rounding adds no product of one noise with itself
            derived = self._derived(t, bits, new)
            if derived is not None:
                return derived
        saver = checkpoint_saver() if bits is None and op.op is None else None
        if saver is not None:
            self._compress_recomputation(saver, t)
            bits = level.boundary_width  # the region is recomputed from these: nonlinear
            if bits is not None and t.is_floating_point() and n >= level.min_numel:
                return self.packer.pack(t, bits, _BOUNDARY)
            return self.keep(t, new, _BOUNDARY)
        if bits is None or not t.is_floating_point() or n < level.min_numel:
            return self.keep(t, new)
        if kind != _MATMUL and row_statistic(t):  # (a matmul's input of width 1: rank 1)
            return self.keep(t, new, None if op.op is None
                              else f"{op_name(op.op)} row statistic")
        if op.only_shape is not None and t.shape != op.only_shape and (
                n != op.only_shape.numel()):
            # a norm's own statistics (mean, rstd): kept exact, and named so (not the norm's
            # input, which the report would otherwise seem to say). The input may come as
            # another shape of its values: an instance norm is a batch norm of the input
            # viewed as one sample of batch x channels
            return self.keep(t, new, f"{op_name(op.op)} statistics")
        ap = self.allocating
        # a [batch, features] input takes per-sample widths in groups along each sample,
        # except a norm's: its backward divides the noise by each feature's own spread, which
        # a group spanning features of other scales (a batch norm's channel of large mean and
        # small spread) makes many times larger than the values (docs/autoprec.md)
        by_feature = op.features and (op.only_shape is not None or ap is None
                                      or not ap.splits_samples(t))
        if ap is not None and kind not in _FIXED_WIDTHS:
            # (a narrow input's width is fixed, and so is a product of unit vectors', as
            # normalize's own copies are: outside the allocator's budget)
            return self.packer.pack_allocated(t, kind, by_feature, bits, op.features)
        zeros = kind == _ZEROS  # (accounted as PackedReLU's are)
        return self.packer.pack(t, bits, "relu" if zeros else _MATMUL if kind is NARROW
                                else kind, by_feature=by_feature, zero_code=zeros)

    def _compress_recomputation(self, saver: object, t: torch.Tensor) -> None:
        """A checkpointed region saves its input ``t``: compress what its recomputation
        saves too, at this level's uniform widths (:mod:`actune.session.recompute`)."""
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
            recomputing = Session()
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

    def run_as(self, kind: str, func, args, kwargs):
        """Run ``func`` with its saved tensors packed at the level's ``kind`` bits."""
        previous = self.label
        self.label = previous.with_kind(kind)
        try:
            return func(*args, **kwargs)
        finally:
            self.label = previous

    @staticmethod
    def unpack_hook(saved: object) -> torch.Tensor:
        cls = saved.__class__  # (no call, unlike isinstance or type: taken for every tensor)
        return saved.get() if cls is Saved or cls is Derived else saved

    # -- tensors rebuilt from another's packed value ---------------------------------------

    def derive(self, t: torch.Tensor, base: Saved, weight: torch.Tensor | None,
               bias: torch.Tensor | None, factor: Saved | None = None,
               function: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """Later savers of ``t`` (or of a view of all of it) keep nothing of their own: they
        rebuild it as ``base * weight + bias`` from ``base``, packed already (a layer norm's
        output from its normalised input, whose rounding then serves both backwards), or as
        ``base * factor`` (a gated product's output from its two packed operands), or as
        ``function(base)`` (GELU's output from its input, packed at a wider width)."""
        if t.is_contiguous():  # (held weakly, as the cache's values are: see _remember)
            for saved in (base, factor):  # (its maker's backward reads it: one reader)
                if saved is not None:
                    saved.readers = max(saved.readers, 1)
            key = _whole_key(t)
            drop = dropper(self.derived, key, 2)
            self.derived[key] = [StorageWeakRef(t.untyped_storage()), t._version,
                                 weakref.ref(base, drop), weight, bias,
                                 None if factor is None else weakref.ref(factor, drop),
                                 _NO_REF, function]
            # (and autocast's copy of it, which a matmul reads: found through the copy's
            # grad_fn, whose input is this function's node; an in-place change of ``t``
            # would have given the copy another)
            try:
                t.grad_fn.actune_derived = key
            except AttributeError:  # (a node of PyTorch's own takes no attribute)
                return

    def _derived(self, t: torch.Tensor, bits: int, new: bool) -> Derived | None:
        """``t`` as a :class:`Derived` if it is a tensor :meth:`derive` named, unchanged since,
        and its base was packed at ``bits`` or more (or by the allocator), else None. ``new``:
        ``t``'s storage was not counted before in this context."""
        if not t.is_contiguous():
            return None
        entry = self.derived.get(_whole_key(t))
        cast = None
        if entry is None:
            if t.dtype not in _CAST_DTYPES:
                return None
            entry = self._cast_entry(t)
            if entry is None:
                return None
            cast = t.dtype
        elif entry[0].expired() or entry[1] != t._version:
            return None
        base_ref, weight, bias, factor_ref = entry[2:6]
        base, factor = base_ref(), factor_ref and factor_ref()
        if base is None or (factor_ref is not None and factor is None):
            return None
        shared = entry[6]()  # one Derived for the savers of one view: rebuilt once
        if (shared is not None and shared.shape == t.shape and shared.base is base
                and shared.factor is factor and shared.dtype is cast):
            derived = shared
        else:
            derived = Derived(base, weight, bias, t.shape, factor,  # (as this saver views it)
                              entry[7], cast)
        ap = self.allocating
        if base.slot is None and ((ap is not None and factor is None and entry[7] is None)
                                  or (derived.bits or 0) < bits):
            return None  # (fixed-width bases: a product's operands, a function's input)
        entry[6] = weakref.ref(derived)
        derived.add_reader()
        if base.slot is not None and ap is not None:
            if new:
                ap.share(base.slot)  # the slot stands for two saved tensors in the budget
            self.packer.touch(base.slot, derived.noise_scale() if ap.collecting else None)
        return derived

    def _cast_entry(self, t: torch.Tensor) -> list | None:
        """The entry of the tensor :meth:`derive` named of which ``t`` (or what ``t`` views
        whole) is autocast's copy, or None."""
        whole = t._base if t._base is not None else t
        fn = whole.grad_fn
        if fn is None or type(fn).__name__ != "ToCopyBackward0" or whole.numel() != t.numel():
            return None
        fn = fn.next_functions[0][0]
        for _ in range(3):  # (a view of all of it cast: GPT-2's Conv1D reads x.view(-1, C))
            if type(fn).__name__ not in ORDER_KEEPING_VIEWS:  # (numel checked below)
                break
            fn = fn.next_functions[0][0]
        key = getattr(fn, "actune_derived", None)  # (storage, offset, numel, dtype)
        return None if key is None or key[2] != t.numel() else self.derived.get(key)

    # -- entering and leaving ------------------------------------------------------------

    def clear(self) -> None:
        """Let go of the packed-storage cache (a forward pass has ended)."""
        self.cache.clear()
        self.accounting.seen.clear()
        self.packer.clear()
        self.derived.clear()
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
            self._exit.enter_context(fused_modules(self.compressing))
        self.levels.append(level)
        self._set_level(level)

    def _set_level(self, level: Level | None) -> None:
        self.level = level
        if level is not None and level is not self._labelled_level:
            self.weighted_labels, self._labelled_level = {}, level
        self._update_allocating()
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
            self.accounting.close()


_local = threading.local()


def _session() -> Session:
    s = getattr(_local, "session", None)
    if s is None:
        s = _local.session = Session()
    return s


def active_level() -> Level | None:
    """The level of this thread's innermost open :func:`compressed` block (None outside)."""
    s = getattr(_local, "session", None)
    return s.levels[-1] if s is not None and s.levels else None


lazy_logits.provide(active_level=active_level)  # (it cannot import this module: see there)


def allow_overwrite(t: torch.Tensor) -> torch.Tensor:
    """Let a training-mode batch norm under :func:`compressed` write its result over ``t``
    (it packs ``t`` first): for a tensor nothing else reads, such as a convolution's output
    whose only reader is that batch norm (:func:`actune.inplace.allow_inplace_norms` finds
    those). Returns ``t``."""
    _session().overwritable[t] = True
    return t


def _defragmenting() -> None:
    """L5: PyTorch's expandable segments on for the run (imported here: the memory package
    imports this module)."""
    from actune.session.allocator_settings import enable_expandable_segments

    enable_expandable_segments()


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
        s.set_allocator(previous)
        s.holds -= 1
        if not s.holds and not s.levels:
            s.clear()


def _copy_of_frozen(t: torch.Tensor, shapes: frozenset) -> bool:
    """Is ``t`` (or the tensor it views) a copy of a frozen weight of one of ``shapes``: a
    tensor outside autograd, as autocast's cast of a weight without gradient is?"""
    if not t.is_leaf or t.requires_grad:
        return False
    base = t._base if t._base is not None else t
    return base.shape in shapes


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
    if lv.defrag and torch.cuda.is_available():
        _defragmenting()
    if outer:
        s.accounting.set_sink(stats)
    previous = s.attach(autoprec)
    s.push(lv)
    try:
        yield lv
    finally:
        s.pop()
        s.set_allocator(previous)
        if lv.defrag and torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()
