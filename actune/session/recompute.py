"""Checkpointed regions under :func:`actune.compressed`: what their recomputation saves is
compressed too.

``torch.utils.checkpoint`` keeps a region's inputs and runs its forward again in backward. The
inputs (the region's boundary) go through the pack hook and are packed at the level's
``boundary_bits`` (default ``nonlinear_bits``: the recomputation reads them nonlinearly).
What the recomputation saves is held until backward reads it, one region at a time; exact,
one ResNet-50 block at a large batch outweighs every block compressed. So, in both of
PyTorch's checkpoint modes:

* **non-reentrant** (``use_reentrant=False``, the tuner's ``ckpt``): the original forward's
  graph reads the recomputed tensors (its nodes are PyTorch's own ops), so the recomputation
  runs the ops as they are, named by :class:`~actune.session.routing.LabelMode`, and each tensor it
  saves
  is packed as that op's rule bits say (a rule that substitutes a function keeps what it saves
  exact here) by a session of the level, and dequantized when backward reads it
  (:class:`PackedRecomputed`, the checkpoint's store of recomputed tensors).
* **reentrant** (``use_reentrant=True``, Hugging Face's default): the recomputation builds a
  graph of its own and runs backward through it; its forward runs under
  ``compressed(level)``, every rule as in a step without checkpointing
  (:func:`compress_reentrant`).

Both are entered from the pack hook when it packs a region's inputs (:func:`checkpoint_saver`
tells it which region saves), with the level then in force, no allocator, and its widths
raised to its ``sensitive_bits`` (4 at L3): held for one region only, the recomputed tensors
cost little at 4 bits, and add less noise than the level's own 2 (docs/training.md).
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint as checkpoint

from actune.session.routing import LabelMode, top_hooks

__all__ = ["REENTRANT", "PackedRecomputed", "checkpoint_saver", "checkpoint_saving",
           "compress_recomputation", "compress_reentrant"]

#: the saved-tensor hooks of a checkpointed region: PyTorch's, and the recomputation's own
#: (:func:`compress_recomputation`)
_CHECKPOINT_HOOKS = ("_checkpoint_hook.", "_recomputation_hook.", "compress_recomputation.")
_SAVE_INPUTS = checkpoint._CheckpointFrame.save_inputs.__code__
_APPLY = torch.autograd.Function.apply.__func__.__code__
#: :func:`checkpoint_saver`'s answer for a reentrant checkpoint (its state is out of reach)
REENTRANT = object()
_MARK = "actune_recompute"


def checkpoint_saving() -> bool:
    """Are a checkpointed region's saved-tensor hooks the innermost ones (its forward or its
    recomputation: what is saved there must be what PyTorch's own ops save)?"""
    top = top_hooks(False)
    return top is not None and getattr(top[0], "__qualname__", "").startswith(_CHECKPOINT_HOOKS)


def checkpoint_saver(depth: int = 2) -> Any:
    """Is the tensor being packed an input that torch.utils.checkpoint keeps to recompute its
    region from? The non-reentrant region's ``_CheckpointFrame`` (its ``save_inputs``),
    :data:`REENTRANT` (the ``CheckpointFunction``'s own saved inputs), or None. Read from the
    callers' frames, ``depth`` up from here: the pack hook is called from C++ by the code that
    saves."""
    frame = sys._getframe(depth)
    for _ in range(2):
        if frame is None:
            return None
        if frame.f_code is _SAVE_INPUTS:
            return frame.f_locals.get("self")
        if frame.f_code is _APPLY:
            return REENTRANT if frame.f_locals.get("cls") is checkpoint.CheckpointFunction else None
        frame = frame.f_back
    return None


class PackedRecomputed(weakref.WeakKeyDictionary):
    """A non-reentrant checkpoint's store of recomputed tensors (weak-keyed by handle, as
    PyTorch's: an entry goes with its saved tensor) that holds what ``session`` packed of each
    as the recomputation saved it (``session.packing``, set by the recomputation's own hooks,
    which see the tensor before checkpointing detaches it), and dequantizes it when read."""

    def __init__(self, session) -> None:
        super().__init__()
        self.session = session

    def __setitem__(self, handle, value) -> None:
        packed = self.session.packing
        super().__setitem__(handle, value if packed is None else packed)

    def __getitem__(self, handle):
        return self.session.unpack_hook(super().__getitem__(handle))


def _whole(t: torch.Tensor) -> tuple:
    """What every saver of all of ``t``'s value shares: storage, offset, size, dtype, version."""
    return (t.untyped_storage()._cdata, t.storage_offset(), t.numel(), t.dtype, t._version)


def compress_recomputation(frame, session) -> None:
    """Make the non-reentrant checkpoint ``frame`` pack what its recomputation saves with
    ``session`` (a session of the level, its own: the recomputation runs in backward, maybe on
    another thread)."""
    if getattr(frame, _MARK, False):
        return
    setattr(frame, _MARK, True)
    session.packing = None
    frame.recomputed = defaultdict(lambda: PackedRecomputed(session))
    recompute = frame.recompute_fn

    def labelled(*args) -> None:
        # the recomputation builds a graph of its own (dropped once it has saved all), whose
        # nodes would hold each recomputed tensor exact until the end: under hooks of its own
        # it holds the packed values the store holds
        store, _ = top_hooks(False)  # (checkpointing's recomputation hooks)
        exact: dict[tuple, bool] = {}

        def pack(t):
            # a storage one op keeps exact (its rule substitutes a function, which does not
            # run here) serves the later savers too, rather than a packed copy beside it
            key = _whole(t)
            packed = t if key in exact else session.pack_hook(t)
            if packed is t:  # (detached, as checkpointing keeps it: not the graph with it)
                exact[key] = True
                packed = t.detach() if t.requires_grad else t
            session.packing = packed
            try:
                store(t)  # (raises once the last tensor the backward needs is saved)
            finally:
                session.packing = None
            return packed

        def unpack(packed):
            return session.unpack_hook(packed)

        session.hook = pack  # (the hooks LabelMode routes under)
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack), LabelMode(session):
                recompute(*args)
        finally:
            session.clear()  # (its cache shares packed values within one recomputation)

    frame.recompute_fn = labelled


def compress_reentrant(node, enter: Callable[[], contextlib.AbstractContextManager]) -> None:
    """Run the recomputation of the reentrant checkpoint whose backward is ``node`` (a
    ``CheckpointFunctionBackward``: its context, holding the region's function) inside the
    context ``enter()`` makes (``compressed(level)``)."""
    if getattr(node, _MARK, False):
        return
    setattr(node, _MARK, True)
    function = node.run_function

    def compressed_run(*args, **kwargs):
        with enter():
            return function(*args, **kwargs)

    node.run_function = compressed_run
