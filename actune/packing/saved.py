"""What the pack hook keeps for one saved tensor, and how backward gets the tensor back.

A :class:`Saved` holds a packed value (quantized codes, a 1-bit mask, small integers, or the
tensor itself), on the device or, at the offloading levels, in pinned host memory; backward
dequantizes it (prefetching the next offloaded value on a side stream). The substituted
autograd functions keep theirs on ``ctx`` and let go of them with :func:`take`.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import weakref
from collections.abc import Callable, Iterator

import torch

from actune import tunables
from actune.packing.batch import dequantize_many
from actune.packing.codes import dequantize_codes, unpack_codes
from actune.packing.columns import dequantize_times, folds_products
from actune.packing.formats import PackedCodes, PackedMask, PackedRows, PackedSamples, PackedTensor
from actune.packing.masks import unpack_mask
from actune.packing.samples import dequantize_samples
from actune.packing.tensors import dequantize, dequantize_into

__all__ = [
    "Derived",
    "DoubleBackwardError",
    "Saved",
    "check_double_backward",
    "get_many",
    "offload_simulated",
    "plain_saving",
    "simulated_offload",
    "take",
]


class DoubleBackwardError(RuntimeError):
    """Raised when backward is differentiated again through compressed activations."""


_DOUBLE_BACKWARD = (
    "actune: double backward (create_graph=True) through compressed activations is not "
    "supported: the saved activations were quantized and are not differentiable. Run this "
    "step without actune.compressed / actune.compress, or at level L0."
)


_SIMULATE_OFFLOAD = contextvars.ContextVar("actune_simulate_offload", default=False)


def offload_simulated() -> bool:
    """Is offload being simulated (an estimate: host memory is the ``meta`` device)?"""
    return _SIMULATE_OFFLOAD.get()


@contextlib.contextmanager
def simulated_offload() -> Iterator[None]:
    """For estimates on the CPU: offloading levels put their packed buffers on the ``meta``
    device, so a memory tracker counts them apart from the device, as host memory."""
    token = _SIMULATE_OFFLOAD.set(True)
    try:
        yield
    finally:
        _SIMULATE_OFFLOAD.reset(token)


class Saved:
    """What the pack hook returns for a compressed tensor.

    With offload on CUDA the packed buffers go to pinned host memory (copied on the current
    stream); in backward, reading one starts copying the one packed before it (the next that
    backward needs) back to the device on a side stream, so transfers overlap compute.
    """

    __slots__ = ("__weakref__", "device", "fetch", "host", "keep", "packed", "prev", "readers",
                 "ready", "slot", "unpacked")

    def __init__(self, packed: PackedTensor | PackedMask | PackedCodes | torch.Tensor,
                 offload: bool, prev: Saved | None = None) -> None:
        self.packed = packed
        self.ready = self.fetch = self.prev = None
        self.host = False  # (on the device: most values, with nothing more to find out)
        self.device: torch.device | None = None  # (where an offloaded value comes back to)
        if offload:
            self._offload(packed, prev)
        self.unpacked: weakref.ref | None = None
        self.slot: int | None = None  # the allocator's slot, when bits were allocated
        self.readers = 0  # backward nodes handed this value, less those that have read it
        self.keep: torch.Tensor | None = None  # the dequantized value, for the next reader

    def _offload(self, packed, prev: Saved | None) -> None:
        """Keep ``packed`` in pinned host memory (a CUDA value; an estimate's simulated
        offload: on the meta device), chained after ``prev`` for prefetching."""
        self.device = packed.device
        simulate = _SIMULATE_OFFLOAD.get()
        self.host = packed.device.type == "cuda" or simulate
        self.prev = prev if self.host and not simulate else None
        if simulate:
            self.packed = _to_device(packed, torch.device("meta"), simulate=True)
        elif self.host:  # pinned host copies, copied asynchronously on the current stream
            self.packed = _to_device(packed, torch.device("cpu"), pin=True)
            self.ready = torch.cuda.Event()
            self.ready.record()

    def prefetch(self) -> None:
        """Start copying the host buffers back to the device on a side stream."""
        if self.fetch is not None or self.ready is None:
            return
        side = _side_stream(self.device)
        side.wait_event(self.ready)  # the forward's device-to-host copy is complete
        with torch.cuda.stream(side):
            packed = _to_device(self.packed, self.device)
            done = torch.cuda.Event()
            done.record(side)
        self.fetch = (packed, done)

    def _from_host(self):
        if self.fetch is None:
            self.prefetch()
        packed, done = self.fetch
        self.fetch = None
        current = torch.cuda.current_stream(self.device)
        current.wait_event(done)
        for t in _tensors(packed):  # allocated on the side stream, used on this one
            t.record_stream(current)
        if self.prev is not None:
            self.prev.prefetch()
        return packed

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes

    def fresh(self) -> torch.Tensor:
        """:meth:`get` as a tensor nothing else holds, which the caller may overwrite."""
        shared = self.unpacked() if self.unpacked is not None else None
        out = self.get()
        if shared is None and self.keep is None and not isinstance(self.packed, torch.Tensor):
            self.unpacked = None  # dequantized for this caller alone
            return out
        return out.clone()

    def get(self) -> torch.Tensor:
        """The value backward reads. A small one (under ``tunables.KEEP_NUMEL`` elements) that more
        readers will read is kept dequantized until the last has (a ReLU's output: the next
        convolution's backward, then the ReLU's, one after the other), not dequantized again."""
        if torch.is_grad_enabled():
            raise DoubleBackwardError(_DOUBLE_BACKWARD)
        out = self.unpacked() if self.unpacked is not None else None
        if out is None:
            packed = self.packed
            if type(packed) is PackedTensor and not self.host:  # (the common case, inline)
                out = dequantize(packed)
                self.unpacked = weakref.ref(out)
            else:
                out = self._dequantized()
        self.readers -= 1
        if self.readers > 0 and out.numel() < tunables.KEEP_NUMEL:
            self.keep = out
        elif self.keep is not None:
            self.keep = None
        return out

    def folds(self) -> bool:
        """Would :meth:`times` take its product as the kernel unpacks (the column layout on
        the CPU, the value not dequantized already, nor on the host)?"""
        return not self.host and not self.held and folds_products(self.packed)

    def times(self, other: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor:
        """The value times ``other`` (written into ``into`` if given; it may be ``other``).
        Where :meth:`folds`, the product is taken as the kernel unpacks: one pass and no
        dequantized copy, not kept for a later reader (which unpacks again)."""
        out = self.folded_times(other, into)
        if out is not None:
            return out
        value = self.get()
        return value * other if into is None else torch.mul(value, other, out=into)

    def folded_times(self, other: torch.Tensor,
                     into: torch.Tensor | None = None) -> torch.Tensor | None:
        """:meth:`times` where the product is taken as the kernel unpacks, else None (nothing
        read: the caller reads the value its own way)."""
        if not self.folds():
            return None
        if torch.is_grad_enabled():
            raise DoubleBackwardError(_DOUBLE_BACKWARD)
        out = dequantize_times(self.packed, other, into)
        if out is not None:
            self.readers -= 1
        return out

    def owned(self) -> torch.Tensor:
        """The value as a tensor nothing else holds (the caller may overwrite it), not kept
        for later readers (each dequantizes again, or folds its product in: :meth:`times`)."""
        if self.host or self.held or not isinstance(self.packed, PackedTensor):
            return self.fresh()
        if torch.is_grad_enabled():
            raise DoubleBackwardError(_DOUBLE_BACKWARD)
        out = dequantize(self.packed)
        self.readers -= 1
        return out

    def get_into(self, out: torch.Tensor) -> torch.Tensor:
        """:meth:`get` written into ``out`` (its shape and dtype, contiguous): a single reader
        that wants the value in a buffer of its own (the loss's gradient) skips allocating
        one more (:func:`actune.packing.tensors.dequantize_into`). Returns ``out``."""
        if (type(self.packed) is not PackedTensor or self.host or self.held
                or self.readers > 1 or torch.is_grad_enabled()):
            return out.copy_(self.get())
        self.readers -= 1
        return dequantize_into(self.packed, out)

    def skip(self) -> None:
        """A reader that will not read after all (it took a value rebuilt from this one)."""
        self.readers -= 1
        if self.readers <= 0:
            self.keep = None

    @property
    def held(self) -> bool:
        """Is the dequantized value alive (kept for a later reader, or held by an earlier
        one)? Then :meth:`fresh` would copy it."""
        return self.keep is not None or (self.unpacked is not None
                                         and self.unpacked() is not None)

    def _dequantized(self) -> torch.Tensor:
        """The packed value dequantized (not alive in another node)."""
        if self.host and self.ready is None:  # simulated offload (estimates)
            packed = _to_device(self.packed, self.device, simulate=True)
        else:
            packed = self._from_host() if self.host else self.packed
        if isinstance(packed, torch.Tensor):
            return packed
        if isinstance(packed, PackedMask):
            out = unpack_mask(packed)
        elif isinstance(packed, PackedCodes):
            out = unpack_codes(packed) if packed.levels is None else dequantize_codes(packed)
        elif isinstance(packed, PackedSamples | PackedRows):
            out = dequantize_samples(packed)
        else:
            out = dequantize(packed)
        self.unpacked = weakref.ref(out)
        return out


def get_many(values: list) -> list[torch.Tensor]:
    """What backward reads from each of ``values`` (a :class:`Saved`, :class:`Derived` or
    tensor): :meth:`Saved.get` each, with the small quantized ones that are on their device
    and not alive elsewhere dequantized in one kernel call
    (:func:`actune.packing.batch.dequantize_many`)."""
    check_double_backward()
    out: list = [v if isinstance(v, torch.Tensor) else None for v in values]
    together = [i for i, v in enumerate(values) if isinstance(v, Saved) and not v.host
                and type(v.packed) is PackedTensor
                and (v.unpacked is None or v.unpacked() is None)]
    if len(together) > 1:
        for i, t in zip(together, dequantize_many([values[i].packed for i in together]),
                        strict=True):
            values[i].unpacked = weakref.ref(t)
            out[i] = t
    return [v.get() if o is None else o for v, o in zip(values, out, strict=True)]


def row_statistic(t: torch.Tensor) -> bool:
    """Is ``t`` one value per row of a features-last activation (``[rows, 1]`` or ``[batch,
    tokens, 1]``: RMSNorm's mean square and ``rsqrt`` of it), which the next op broadcasts
    over the row? Its rounding noise would be shared by every element of the row (coherent,
    not averaged over the features), and it is ``1 / width`` of the activations' size: such
    tensors are kept exact. (Not an image of width 1: ``[N, C, H, 1]`` has four dims.)"""
    return 2 <= t.dim() <= 3 and t.shape[-1] == 1


class Derived:
    """A saved tensor rebuilt from another's packed value: ``base * weight + bias`` (per
    feature, along the last dims), ``base * factor`` (two packed values), or ``function(base)``,
    as ``shape``. A layer norm's output is its normalised input times its weight plus its bias;
    a gated product's output is its two operands multiplied; GELU's output is GELU of its input
    (``function`` corrects the bias a rounded input leaves in it): a matmul that saves that
    output reads the packed values its maker keeps anyway instead of packing another copy (the
    rounding is unbiased in each, independent between the two factors, and linear in every
    backward that reads it). Its bytes are the base's (and factor's), counted where they were
    packed."""

    __slots__ = ("__weakref__", "base", "bias", "dtype", "factor", "function", "keep",
                 "readers", "shape", "weight")

    def __init__(self, base: Saved, weight: torch.Tensor | None, bias: torch.Tensor | None,
                 shape: torch.Size | None = None, factor: Saved | None = None,
                 function: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 dtype: torch.dtype | None = None) -> None:
        self.base, self.weight, self.bias, self.shape = base, weight, bias, shape
        self.factor = factor
        self.function = function  # elementwise, of the base's value (GELU's output)
        self.dtype = dtype  # autocast's: the saver's copy was cast to it (None: as rebuilt)
        self.readers = 0  # savers handed this value, less those that have read it
        self.keep: torch.Tensor | None = None  # the rebuilt value, for the next reader

    @property
    def bits(self) -> int | None:
        """The narrowest width of the packed values (None: not uniformly quantized)."""
        widths = [getattr(p.packed, "bits", None) for p in (self.base, self.factor)
                  if p is not None]
        return None if None in widths else min(widths)

    def noise_scale(self) -> torch.Tensor | None:
        """How much larger rounding noise is in the rebuilt tensor than in the base: the mean
        square of ``weight`` (a device scalar; None: the same)."""
        if self.weight is None:
            return None
        return self.weight.detach().float().square().mean()

    def add_reader(self) -> None:
        """One more saver reads this value: each read rebuilds it or takes the kept copy, and
        counts as a read of the packed values (which may keep theirs dequantized for their
        maker's backward, next: a norm's, a gated product's)."""
        self.readers += 1
        for saved in self._sources():
            saved.readers += 1

    def _sources(self) -> tuple[Saved, ...]:
        """The packed values this one is rebuilt from."""
        return (self.base,) if self.factor is None else (self.base, self.factor)

    def get(self) -> torch.Tensor:
        """The rebuilt value; a small one (under ``tunables.KEEP_NUMEL`` elements) kept for the
        next of
        several readers (the q, k and v projections reading one norm's output)."""
        if self.keep is not None:
            out = self.keep
            for saved in self._sources():
                saved.skip()
        else:
            out = self._rebuilt()
        self.readers -= 1
        self.keep = out if self.readers > 0 and out.numel() < tunables.KEEP_NUMEL else None
        return out

    def _rebuilt(self) -> torch.Tensor:
        # (the base, the weight and the bias share the output's dtype: the norm's rule
        # shares only then)
        factor = self.factor
        if factor is not None and factor.folds() and self.base.folds():
            # (a gated product: one operand dequantized, the other's product folded into its
            # unpack, in place; the product's own backward folds its gradients alike)
            out = self.base.owned()
            out = factor.times(out, into=out)
        else:
            out = self.base.get()
            if factor is not None:
                out = out * factor.get()
            if self.function is not None:
                out = self.function(out)
        if self.weight is not None:
            out = out * self.weight if self.bias is None else torch.addcmul(self.bias, out,
                                                                             self.weight)
        elif self.bias is not None:
            out = out + self.bias
        if self.dtype is not None:
            out = out.to(self.dtype)
        return out if self.shape is None else out.reshape(self.shape)


_SIDE_STREAMS: dict[torch.device, object] = {}


def _side_stream(device: torch.device):
    """One side stream per device for prefetching offloaded activations."""
    stream = _SIDE_STREAMS.get(device)
    if stream is None:
        stream = _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return stream


def _tensors(p) -> tuple[torch.Tensor, ...]:
    if isinstance(p, torch.Tensor):
        return (p,)
    if isinstance(p, PackedMask):
        return (p.bits8,)
    if isinstance(p, PackedCodes):
        return (p.bytes8,)
    if isinstance(p, PackedSamples):
        return tuple(t for idx, part in p.parts for t in (idx, *_tensors(part)))
    if isinstance(p, PackedRows):
        return (p.codes, p.meta, p.row_bits, p.row_offset)
    return (p.codes,) if p.meta is None else (p.codes, p.meta)


def _to_device(p, device: torch.device, pin: bool = False, simulate: bool = False):
    """``p``'s tensors on ``device`` (``pin``: in pinned host memory; ``simulate``: fake
    tensors, whose values do not matter: new ones of the same shape, a cheaper operation)."""

    def move(t: torch.Tensor) -> torch.Tensor:
        if simulate:
            return torch.empty_like(t, device=device)
        if pin:
            host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
            return host.copy_(t, non_blocking=True)
        return t.to(device, non_blocking=True)

    if isinstance(p, torch.Tensor):
        return move(p)
    if simulate and isinstance(p, PackedTensor):  # only the bytes count: one buffer of all
        return dataclasses.replace(p, codes=torch.empty(p.nbytes, dtype=torch.uint8,
                                                        device=device), meta=None)
    if isinstance(p, PackedMask):
        return PackedMask(move(p.bits8), p.shape)
    if isinstance(p, PackedCodes):
        return dataclasses.replace(p, bytes8=move(p.bytes8))
    if isinstance(p, PackedSamples):
        return dataclasses.replace(p, parts=tuple((move(idx), _to_device(part, device, pin,
                                                                          simulate))
                                                  for idx, part in p.parts))
    if isinstance(p, PackedRows):
        return dataclasses.replace(p, codes=move(p.codes), meta=move(p.meta),
                                   row_bits=move(p.row_bits), row_offset=move(p.row_offset))
    return dataclasses.replace(p, codes=move(p.codes), meta=move(p.meta))


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def plain_saving():
    """Saved-tensor hooks that keep tensors as they are, above actune's: for a recomputation
    inside a substituted function's backward (PyTorch saves as it would, nothing is routed)."""
    return torch.autograd.graph.saved_tensors_hooks(_same, _same)


def check_double_backward() -> None:
    if torch.is_grad_enabled():
        raise DoubleBackwardError(_DOUBLE_BACKWARD)


_keep_graph = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", lambda: True)


def take(ctx, name: str):
    """What a substituted function's forward kept on ``ctx`` as ``name``, let go once read
    unless the graph is retained (``retain_graph=True``): autograd's own lifetime for saved
    tensors, so packed values are freed as backward moves down, not when it ends."""
    value = getattr(ctx, name)
    if value is None:
        raise RuntimeError("Trying to backward through the graph a second time: its packed "
                           "values were freed. Pass retain_graph=True to the first backward.")
    if not _keep_graph():
        setattr(ctx, name, None)
    return value
