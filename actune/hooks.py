"""compressed(level): compress what autograd saves, for any architecture.

Inside ``with actune.compressed("L3"):`` two public PyTorch mechanisms work together:

* ``torch.autograd.graph.saved_tensors_hooks`` packs every tensor autograd saves and unpacks it
  when backward needs it. The unpacked (dequantized) tensor lives only while its backward node
  runs; the packed form is the only copy kept between forward and backward.
* a ``TorchFunctionMode`` sees each functional call (modules call them too), so the pack hook
  knows which op is saving a tensor and how that op's backward uses it:

  - convolutions, linear layers, matmuls (``matmul_bits``) and norms and elementwise products
    (``other_bits``) use their saved tensors linearly: stochastic rounding keeps their
    gradients unbiased, so those tensors are quantized;
  - ReLU / ReLU6 / hardtanh / leaky ReLU need only a 1-bit mask, dropout already saves a
    boolean mask (stored at 1 bit), max-pool needs only each window's argmax offset: these are
    stored exactly (``masks``);
  - GELU, SiLU, sigmoid and tanh would read their input or output through a nonlinearity, which
    turns quantization noise into bias; they save their derivative instead (quantized, used
    linearly: unbiased);
  - softmax's backward, ``y * (g - sum(g * y))``, is quadratic in its output ``y``; it saves two
    independently rounded copies, one for each factor, which keeps the product unbiased;
  - every other op (exp, log, division, fused attention, losses...) keeps its saved tensors
    exact: a quantized operand of a nonlinear backward would bias the gradient silently.

Parameters (and their autocast copies) stay references; a storage saved by several ops is
packed once; boolean masks take 1 bit; tensors with fewer than ``level.min_numel`` elements are
kept. Double backward (``create_graph=True``) raises: the saved values are not differentiable.

This module holds the session (levels, the packed-storage cache, the statistics) and the
routing; the functions that stand in for ops are in :mod:`actune.substitutes`, and what is
kept for one saved tensor (device or host, and how it comes back) in :mod:`actune.saved`.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F  # noqa: N812
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

from actune import substitutes
from actune.autoprec import AutoPrecision, Plan
from actune.levels import Level, get_level
from actune.quant import PackedMask, pack_mask, quantize, quantize_samples
from actune.saved import Saved
from actune.substitutes import (
    LeanBatchNorm,
    MaskedDropout,
    MaskedLinear,
    OffsetMaxPool,
    OrderedConv,
    PackedReLU,
    SavedDerivative,
    TwoCopySoftmax,
    arg,
    as_tuple,
    conv_args,
    gelu_derivative,
    inside,
    positive_after,
    positive_before,
    silu_derivative,
)

__all__ = ["CompressionStats", "allow_overwrite", "compressed", "shared_cache"]


# Which ops' saved tensors are quantized, and with which of the level's bit widths.
_MATMUL = "matmul"
_OTHER = "other"
_ALLOCATED = "allocated"  # cache-key marker: bits chosen by the allocator


@dataclass
class CompressionStats:
    """Bytes autograd would have kept, and what was kept instead, during one context."""

    saved_bytes: int = 0  # bytes of the tensors handed to the pack hook (each storage once)
    kept_bytes: int = 0  # bytes actually held: packed forms plus tensors kept as they were
    packed: int = 0
    kept: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        return self.saved_bytes / self.kept_bytes if self.kept_bytes else 1.0


def _is_parameter_like(t: torch.Tensor) -> bool:
    if t.is_leaf:  # (a parameter is a leaf: most saved tensors skip the slow isinstance)
        return t.requires_grad or isinstance(t, torch.nn.Parameter)
    base = t._base
    if base is not None and isinstance(base, torch.nn.Parameter):  # a transposed weight
        return True
    fn = t.grad_fn  # an autocast copy of a parameter: ToCopyBackward0 -> AccumulateGrad
    if fn is not None and fn.name() == "ToCopyBackward0":
        nxt = fn.next_functions
        return len(nxt) == 1 and nxt[0][0] is not None and nxt[0][0].name() == "AccumulateGrad"
    return False


def _storage_key(t: torch.Tensor) -> tuple:
    # the storage's address (what StorageWeakRef(...).cdata holds), without a weak reference
    return (t.untyped_storage()._cdata, t.storage_offset(), tuple(t.shape), t.stride(),
            t.dtype, t._version)


class _Session:
    """The per-thread state of nested compressed() contexts: the level stack, the op being
    run, and the packed-storage cache that makes a storage saved by several ops pack once."""

    def __init__(self) -> None:
        self.levels: list[Level] = []
        self.holds = 0  # forward passes of compress()ed models that share one cache
        self.kind: str | None = None
        self.cache: dict[tuple, object] = {}
        self.seen: dict[tuple, StorageWeakRef] = {}
        self.last_offloaded: Saved | None = None
        self.stats = CompressionStats()
        self.autoprec: AutoPrecision | None = None
        self.touched: list[int] | None = None  # allocator slots read by the op being run
        self.only_shape: torch.Size | None = None  # a norm: only tensors of its input's shape
        self.references: tuple = ()  # a norm's other tensor arguments (buffers): references
        self.last_matmul = None  # statistics steps: the last matmul call (output, func, args)
        # tensors a batch norm may write its result over, once (allow_overwrite)
        self.overwritable = WeakIdKeyDictionary()
        self._exit: contextlib.ExitStack | None = None

    @property
    def level(self) -> Level:
        return self.levels[-1]

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
        return ap if ap is not None and self.levels and self.level.avg_bits is not None else None

    def bits_for(self, kind: str | None) -> int | None:
        if kind == _MATMUL:
            return self.level.matmul_bits
        if kind == _OTHER:
            return self.level.other_bits
        return None

    # -- hooks ---------------------------------------------------------------------------

    def pack_hook(self, t: torch.Tensor) -> object:
        if _is_parameter_like(t) or (self.references and any(t is r for r in self.references)):
            return t  # a parameter or a buffer (running statistics): costs nothing
        new = self.count(t)
        level = self.level
        if t.dtype == torch.bool:
            if level.masks and t.numel() >= level.min_numel:
                return self._pack(t, None, "mask", lambda: pack_mask(t))
            return self._keep(t, new)
        bits = self.bits_for(self.kind)
        if bits is None or not t.is_floating_point() or t.numel() < level.min_numel:
            return self._keep(t, new)
        if self.only_shape is not None and t.shape != self.only_shape:
            return self._keep(t, new)  # a norm's own statistics (mean, rstd): kept exact
        if self.allocator() is not None:
            return self._pack_allocated(t, self.kind)
        return self._pack(t, bits, self.kind,
                          lambda: quantize(t, bits, group_size=level.group_size))

    @staticmethod
    def unpack_hook(saved: object) -> torch.Tensor:
        return saved.get() if isinstance(saved, Saved) else saved

    # -- accounting: what autograd would keep (each storage once) and what is kept instead --

    def count(self, t: torch.Tensor) -> bool:
        """Count ``t`` as an activation autograd would keep; False if its storage was already
        counted in this context."""
        key = _storage_key(t)[:-1]
        seen = self.seen.get(key)
        if seen is not None and not seen.expired():
            return False
        self.seen[key] = StorageWeakRef(t.untyped_storage())
        self.stats.saved_bytes += t.numel() * t.element_size()
        return True

    def _keep(self, t: torch.Tensor, new: bool) -> torch.Tensor:
        if new:
            self.stats.kept += 1
            self.stats.kept_bytes += t.numel() * t.element_size()
            self.stats.by_kind["exact"] = (self.stats.by_kind.get("exact", 0)
                                           + t.numel() * t.element_size())
        return t

    def _new(self, packed) -> Saved:
        """A saved value; offloaded ones are chained in packing order for prefetching."""
        saved = Saved(packed, self.level.offload, self.last_offloaded)
        if saved.ready is not None:
            self.last_offloaded = saved
        return saved

    def _hold(self, saved: Saved, kind: str, replaces: tuple = ()) -> Saved:
        """Account ``saved`` as kept (and the tensors it ``replaces`` as what PyTorch kept)."""
        for r in replaces:
            self.count(r)
        self.stats.packed += 1
        self.stats.kept_bytes += saved.nbytes
        self.stats.by_kind[kind] = self.stats.by_kind.get(kind, 0) + saved.nbytes
        return saved

    # -- the packed-storage cache ----------------------------------------------------------

    def _cached(self, key: tuple) -> Saved | None:
        entry = self.cache.get(key)
        if entry is None:
            return None
        alive, saved = entry
        return None if alive.expired() else saved  # a freed storage's address can come back

    def _remember(self, t: torch.Tensor, bits: int | None, saved: Saved,
                  bumps: int = 0) -> None:
        key = _storage_key(t)
        key = (*key[:-1], key[-1] + bumps, bits)
        self.cache[key] = (StorageWeakRef(t.untyped_storage()), saved)

    def _pack_allocated(self, t: torch.Tensor, kind: str) -> Saved:
        """Pack with the bits the allocator gives this slot (found in the cache if the storage
        was packed already: this op reads that slot too)."""
        found = self._cached((*_storage_key(t), _ALLOCATED))
        if found is not None and isinstance(found.packed, PackedMask):
            found = None  # kept as a mask only (no reader at the last statistics step)
        if found is None:
            packed, slot = self._quantize_planned(t, False)
            found = self._hold(self._new(packed), kind)
            found.slot = slot
            self._remember(t, _ALLOCATED, found)
        self._touch(found.slot)
        return found

    def _quantize_planned(self, t: torch.Tensor, zero_code: bool) -> tuple[object, int]:
        """Pack ``t`` as the allocator plans its next slot; returns the packed form and slot."""
        ap = self.autoprec
        plan: Plan = ap.plan(t, zero_code)
        group = self.level.group_size
        if plan.bits == 0:
            return pack_mask(t > 0), plan.slot
        if plan.by_rank:
            packed = quantize_samples(t, plan.by_rank, group_size=group, zero_code=zero_code,
                                      weight=plan.weight)
        else:
            packed = quantize(t, plan.bits, group_size=group, zero_code=zero_code)
        ap.observe(plan, packed, t)
        return packed, plan.slot

    def _touch(self, slot: int | None) -> None:
        if self.touched is not None and slot is not None:
            self.touched.append(slot)

    def _pack(self, t: torch.Tensor, bits: int | None, kind: str, make: Callable) -> Saved:
        found = self._cached((*_storage_key(t), bits))
        if found is not None:
            return found
        saved = self._new(make())
        self._remember(t, bits, saved)
        return self._hold(saved, kind)

    # -- packing for the substituted functions (not through the hooks) ---------------------

    def pack_value(self, t: torch.Tensor, bits: int, kind: str, replaces: tuple = (),
                   share_as: torch.Tensor | None = None, zero_code: bool = False,
                   dirty: bool = False, reads: bool = True) -> Saved:
        """Pack ``t`` in place of the tensors ``replaces`` that PyTorch's op would save; with
        ``share_as``, later savers of that tensor reuse this packed copy (``dirty``: the
        function marks it dirty, which bumps its version once more after forward). ``reads``:
        this op's backward reads the rounded values (not only its exact zeros)."""
        if self.allocator() is not None:
            packed, slot = self._quantize_planned(t, zero_code)
            saved = self._hold(self._new(packed), kind, replaces)
            saved.slot = slot
            if reads:
                self._touch(saved.slot)
            if share_as is not None:
                self._remember(share_as, _ALLOCATED, saved, bumps=int(dirty))
            return saved
        packed = quantize(t, bits, group_size=self.level.group_size, zero_code=zero_code)
        saved = self._hold(self._new(packed), kind, replaces)
        if share_as is not None:
            self._remember(share_as, bits, saved, bumps=int(dirty))
        return saved

    def pack_small_ints(self, values: torch.Tensor, kind: str, replaces: tuple = ()) -> Saved:
        """Integers in [0, 256) kept exactly in one byte each."""
        return self._hold(self._new(values.to(torch.uint8)), kind, replaces)

    def pack_bool(self, mask: torch.Tensor, kind: str, replaces: tuple = ()) -> Saved:
        return self._hold(self._new(pack_mask(mask)), kind, replaces)

    # -- entering and leaving ------------------------------------------------------------

    def push(self, level: Level) -> None:
        if not self.levels:
            self._exit = contextlib.ExitStack()
            self._exit.enter_context(
                torch.autograd.graph.saved_tensors_hooks(self.pack_hook, self.unpack_hook))
            self._exit.enter_context(_FunctionMode(self))
        self.levels.append(level)

    def pop(self) -> None:
        self.levels.pop()
        if not self.levels:
            exit_stack, self._exit = self._exit, None
            if not self.holds:
                self.cache.clear()
                self.seen.clear()
                self.last_offloaded = None
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
            s.cache.clear()
            s.seen.clear()
            s.last_offloaded = None


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
    if lv.exact and stats is None:  # L0: plain PyTorch, not even the hooks
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


# ---------------------------------------------------------------------------------------------
# The function mode: routes each call.


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


_MATMUL_FUNCS = {
    F.linear, F.bilinear, F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d,
    F.conv_transpose3d, torch.matmul, torch.mm, torch.bmm, torch.addmm, torch.baddbmm,
    torch.einsum, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.Tensor.__rmatmul__,
    torch.Tensor.mm, torch.Tensor.bmm,
}
_OTHER_FUNCS = {
    F.batch_norm, F.layer_norm, F.group_norm, F.instance_norm, F.rms_norm, torch.mul,
    torch.Tensor.mul, torch.Tensor.__mul__, torch.Tensor.__rmul__, F.embedding,
}
_RELU = {F.relu, torch.relu, torch.Tensor.relu}
_RELU_INPLACE = {F.relu_, torch.relu_, torch.Tensor.relu_}
_SIGMOID = {torch.sigmoid, F.sigmoid, torch.Tensor.sigmoid}
_TANH = {torch.tanh, F.tanh, torch.Tensor.tanh}
_SOFTMAX = {F.softmax, torch.softmax, torch.Tensor.softmax}
_MAXPOOL = {F.max_pool2d: 2, F.max_pool3d: 3}  # 1-d keeps PyTorch's own (exact) indices


class _FunctionMode(TorchFunctionMode):
    def __init__(self, session: _Session) -> None:
        super().__init__()
        self.s = session

    # torch.compile cannot capture this routing (Python state, hooks): inside a compiled
    # region every call under compressed() runs eagerly, so compression stays correct.
    @torch.compiler.disable(recursive=True)
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not args or not _needs_grad(*args, *kwargs.values()):
            return func(*args, **kwargs)
        s = self.s
        ap = s.allocator()
        if ap is None or not ap.collecting:
            out = self._run(func, args, kwargs)
            if ap is not None and ap.tracking:
                ap.track(_first_tensor(out))
            return out
        # a statistics step: the gradient of this op's output weighs the slots it reads
        outer, s.touched = s.touched, []
        try:
            out = self._run(func, args, kwargs)
        finally:
            touched, s.touched = s.touched, outer
        first = _first_tensor(out)
        if first is not None and (touched or func in _MATMUL_FUNCS):
            self._watch(ap, touched, first, func, args, kwargs)
        if ap.tracking:
            ap.track(first)
        return out

    def _watch(self, ap: AutoPrecision, touched: list[int], out: torch.Tensor, func, args,
               kwargs) -> None:
        """Tell the allocator how rounding noise in what ``func`` saved reaches parameter
        gradients (statistics steps only; device scalars, no synchronisation; derivation in
        docs/autoprec.md). A matmul's input noise enters its own weight gradient, ``fan_in``
        elements per output gradient element; the size of that weight gradient,
        ``fan_in * mean(x**2) * |grad|**2``, is what noise relayed from above it perturbs. An
        elementwise op's noise enters the gradient of its input and is relayed to every weight
        gradient below it (a norm's noise relative to its input's spread, hence ``1 / var``)."""
        x = args[0]
        if func in _MATMUL_FUNCS:
            fan = _fan_in(func, args, kwargs)
            size = (x.detach().float().square().mean() * fan
                    if isinstance(x, torch.Tensor) and x.is_floating_point() else None)
            ap.watch(touched, out, fan, relayed=False, size=size)
            self.s.last_matmul = (weakref.ref(out), func, args, kwargs)
            return
        if func in _NORMS and isinstance(x, torch.Tensor) and x.dim() >= 2:
            dims = (0, *range(2, x.dim())) if func is F.batch_norm else (x.dim() - 1,)
            scale = (x.detach().float().var(dim=dims) + 1e-5).reciprocal().mean()
            weight = arg(args, kwargs, 3, "weight", None) if func is F.batch_norm else None
            coherent = None
            if isinstance(weight, torch.Tensor):
                coherent = _coherent(self.s.last_matmul, x, weight, dims)
            self.s.last_matmul = None  # holds the matmul's input: let it go
            ap.watch(touched, out, scale, relayed=True,
                     norm=(weight, dims, coherent) if isinstance(weight, torch.Tensor)
                     else None)
            if isinstance(weight, torch.Tensor):  # and directly its own weight's gradient
                ap.watch(touched, out, scale, relayed=False)
            return
        ap.watch(touched, out, 1.0, relayed=True)

    def _run(self, func, args, kwargs):
        s = self.s
        level = s.level
        replaced = self._replace(func, args, kwargs, level) if not level.exact else None
        if replaced is not None:
            return replaced
        kind = _MATMUL if func in _MATMUL_FUNCS else _OTHER if func in _OTHER_FUNCS else None
        # a norm's backward reads its statistics (mean, rstd) nonlinearly: only its input,
        # the tensor of the input's shape, may be rounded
        only, refs = None, ()
        if func in _NORMS and isinstance(args[0], torch.Tensor):
            only = args[0].shape  # and its weight, bias and running statistics: references
            refs = tuple(a for a in (*args[1:], *kwargs.values()) if isinstance(a, torch.Tensor))
        conv = None
        if func in _PLAIN_CONVS and level.matmul_bits is not None:
            conv = conv_args(func, args, kwargs)
        norm = None
        if func is F.batch_norm and level.other_bits is not None:
            norm = _lean_norm_args(s, args, kwargs)
        previous = s.kind, s.only_shape, s.references
        s.kind, s.only_shape, s.references = kind, only, refs
        try:
            if conv is not None:
                return OrderedConv.apply(*conv)
            if norm is not None:
                out = LeanBatchNorm.apply(*norm, s.pack_hook)
                if out is norm[0]:  # overwritten: a new value, in its own storage in PyTorch
                    s.seen.pop(_storage_key(out)[:-1], None)
                return out
            return func(*args, **kwargs)
        finally:
            s.kind, s.only_shape, s.references = previous

    def _replace(self, func, args, kwargs, level: Level):
        s = self.s
        x = args[0]
        if not isinstance(x, torch.Tensor):
            return None
        if level.masks:
            inplace = func in _RELU_INPLACE or (func is F.relu and kwargs.get("inplace"))
            if func in _RELU or func in _RELU_INPLACE:
                bits = level.matmul_bits or level.other_bits
                if bits is not None and bits >= 2 and x.is_floating_point():
                    return PackedReLU.apply(x, bool(inplace), bits, s)
                fn = torch.relu_ if inplace else torch.relu
                return MaskedLinear.apply(x, fn, positive_after, 0.0, bool(inplace), s)
            if func in (F.relu6, F.hardtanh):
                lo, hi = (0.0, 6.0) if func is F.relu6 else (
                    arg(args, kwargs, 1, "min_val", -1.0), arg(args, kwargs, 2, "max_val", 1.0))
                inplace = bool(arg(args, kwargs, 3 if func is F.hardtanh else 1, "inplace",
                                   False))
                fn = (lambda t: t.clamp_(lo, hi)) if inplace else (lambda t: t.clamp(lo, hi))
                return MaskedLinear.apply(x, fn, inside(lo, hi), 0.0, inplace, s)
            if func is F.leaky_relu:
                slope = float(arg(args, kwargs, 1, "negative_slope", 0.01))
                inplace = bool(arg(args, kwargs, 2, "inplace", False))
                fn = (lambda t: F.leaky_relu_(t, slope)) if inplace else (
                    lambda t: F.leaky_relu(t, slope))
                return MaskedLinear.apply(x, fn, positive_before, slope, inplace, s)
            if func is F.dropout:
                p = float(arg(args, kwargs, 1, "p", 0.5))
                training = bool(arg(args, kwargs, 2, "training", True))
                inplace = bool(arg(args, kwargs, 3, "inplace", False))
                if not training or p == 0.0:
                    return x
                if 0.0 < p < 1.0:
                    return MaskedDropout.apply(x, p, inplace, s)
            dims = _MAXPOOL.get(func)
            if dims and x.dim() >= dims + 1 and not arg(args, kwargs, 6, "return_indices",
                                                        False):
                kernel = as_tuple(arg(args, kwargs, 1, "kernel_size", None), dims)
                stride = as_tuple(arg(args, kwargs, 2, "stride", None) or kernel, dims)
                padding = as_tuple(arg(args, kwargs, 3, "padding", 0), dims)
                dilation = as_tuple(arg(args, kwargs, 4, "dilation", 1), dims)
                ceil_mode = bool(arg(args, kwargs, 5, "ceil_mode", False))
                if math.prod(kernel) <= 256:
                    return OffsetMaxPool.apply(x, dims, kernel, stride, padding, dilation,
                                               ceil_mode, s)
        bits = level.other_bits
        if bits is None or x.numel() < level.min_numel:
            return None
        if func is F.gelu:
            approximate = arg(args, kwargs, 1, "approximate", "none")
            return SavedDerivative.apply(x, lambda t: F.gelu(t, approximate=approximate),
                                         gelu_derivative(approximate), bits, s, True)
        if func is F.silu:
            if arg(args, kwargs, 1, "inplace", False):
                return None
            return SavedDerivative.apply(x, F.silu, silu_derivative, bits, s, True)
        if func in _SIGMOID:
            return SavedDerivative.apply(x, torch.sigmoid, lambda _x, y: y * (1 - y), bits, s,
                                         False)
        if func in _TANH:
            return SavedDerivative.apply(x, torch.tanh, lambda _x, y: 1 - y * y, bits, s, False)
        if func in _SOFTMAX:
            dim = arg(args, kwargs, 1, "dim", None)
            if dim is None:
                return None
            dtype = kwargs.get("dtype")
            return TwoCopySoftmax.apply(x, dim, dtype, bits, s)
        return None


def _lean_norm_args(s: _Session, args, kwargs) -> tuple | None:
    """(x, weight, bias, running_mean, running_var, momentum, eps, overwrite) of a training-mode
    batch norm that :class:`LeanBatchNorm` should run, or None (PyTorch's own: small inputs,
    half precision, autocast)."""
    x = args[0]
    weight, bias = arg(args, kwargs, 3, "weight", None), arg(args, kwargs, 4, "bias", None)
    momentum = arg(args, kwargs, 6, "momentum", 0.1)
    if (not arg(args, kwargs, 5, "training", False) or x.dim() < 2
            or x.numel() < substitutes.LEAN_NUMEL or x.dtype not in (torch.float32, torch.float64)
            or torch.is_autocast_enabled(x.device.type) or not isinstance(momentum, float | int)
            or any(t is not None and t.dtype != x.dtype for t in (weight, bias))):
        return None
    ap = s.allocator()
    overwrite = (s.overwritable.pop(x, False) and not x.is_leaf and x._base is None
                 and not (ap is not None and ap.collecting))  # statistics read the input after
    return (x, weight, bias, arg(args, kwargs, 1, "running_mean", None),
            arg(args, kwargs, 2, "running_var", None), float(momentum),
            float(arg(args, kwargs, 7, "eps", 1e-5)), overwrite)


_NORMS = {F.batch_norm, F.layer_norm, F.group_norm, F.instance_norm, F.rms_norm}
_PLAIN_CONVS = {F.conv1d, F.conv2d, F.conv3d}
_CONVS = {F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d,
          F.conv_transpose3d}


def _coherent(last, h: torch.Tensor, gamma: torch.Tensor, dims) -> torch.Tensor | None:
    """Per channel ``gamma**2 * invstd**4 * |sum x_hat * x_patch|**2 / M**2`` for a batch norm
    whose input ``h`` a convolution or linear layer just produced from ``x``: the factor by which
    the channel's rounding noise, shared by all its elements through the mean in batch norm's
    backward, reaches that layer's weight gradient coherently (docs/autoprec.md)."""
    if last is None or last[0]() is not h or last[1] not in (*_CONVS, F.linear):
        return None
    _, func, args, kwargs = last
    x, w = args[0], arg(args, kwargs, 1, "weight", None)
    if not isinstance(w, torch.Tensor) or func in _CONVS - {F.conv1d, F.conv2d, F.conv3d}:
        return None
    with torch.no_grad():
        hd = h.detach().float()
        mean = hd.mean(dim=dims, keepdim=True)
        invstd = (hd.var(dim=dims, unbiased=False, keepdim=True) + 1e-5).rsqrt()
        x_hat = (hd - mean) * invstd
        xd = x.detach().float()
        if func is F.linear:
            a = x_hat.reshape(-1, x_hat.shape[-1]).t() @ xd.reshape(-1, xd.shape[-1])
        else:
            stride = arg(args, kwargs, 3, "stride", 1)
            padding = arg(args, kwargs, 4, "padding", 0)
            dilation = arg(args, kwargs, 5, "dilation", 1)
            groups = arg(args, kwargs, 6, "groups", 1)
            if isinstance(padding, str):
                return None
            n = w.dim() - 2
            a = torch.ops.aten.convolution_backward(
                x_hat, xd, w.detach().float(), None, as_tuple(stride, n), as_tuple(padding, n),
                as_tuple(dilation, n), False, [0] * n, groups, [False, True, False])[1]
        count = h.numel() // h.shape[1]
        per_channel = a.reshape(a.shape[0], -1).square().sum(1)
        return (gamma.detach().float().square() * invstd.reshape(-1) ** 4 * per_channel
                / count**2)


@functools.lru_cache(maxsize=256)
def _inside_share(size: int, k: int, stride: int, pad: int, dilation: int) -> float:
    """The share of a kernel's taps, over all output positions, that land inside the input."""
    outputs = (size + 2 * pad - dilation * (k - 1) - 1) // stride + 1
    if outputs <= 0:
        return 1.0
    inside = sum(0 <= o * stride - pad + j * dilation < size
                 for o in range(outputs) for j in range(k))
    return inside / (outputs * k)


def _fan_in(func, args, kwargs) -> float:
    """How many saved elements each output element of ``func`` reads per weight (the factor
    by which rounding noise in its input reaches its weight gradient; 1 for elementwise ops)."""
    if func in _CONVS:
        weight = arg(args, kwargs, 1, "weight", None)
        if not isinstance(weight, torch.Tensor):
            return 1
        fan = float(weight[0].numel())
        x = args[0]
        if func in (F.conv1d, F.conv2d, F.conv3d) and isinstance(x, torch.Tensor):
            n = weight.dim() - 2
            padding = arg(args, kwargs, 4, "padding", 0)
            if not isinstance(padding, str):  # taps that fall on the padding read nothing
                stride = as_tuple(arg(args, kwargs, 3, "stride", 1), n)
                dilation = as_tuple(arg(args, kwargs, 5, "dilation", 1), n)
                for size, k, st, p, d in zip(x.shape[-n:], weight.shape[2:], stride,
                                             as_tuple(padding, n), dilation, strict=True):
                    fan *= _inside_share(int(size), int(k), int(st), int(p), int(d))
        return fan
    if func in _MATMUL_FUNCS and isinstance(args[0], torch.Tensor) and args[0].dim():
        return int(args[0].shape[-1])
    return 1


def _first_tensor(out) -> torch.Tensor | None:
    """``out`` if it is a tensor, else the first tensor of a tuple or list of outputs."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, tuple | list):
        return next((o for o in out if isinstance(o, torch.Tensor)), None)
    return None


