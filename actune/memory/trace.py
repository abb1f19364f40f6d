"""Record one step's allocations and frees, in order, as the memory tracker sees them, for
the GPU model (:mod:`actune.memory.gpu_model`) to replay through the caching allocator.

Beside the tracked storages the trace holds each op's inner GPU temporaries
(:mod:`actune.memory.gpu_temporaries`), allocated before the op's outputs and freed after,
and notes whether the step ran any cuBLAS op. A gradient sum that a plain step would do in
place (the tracker sees it out of place, see :mod:`actune.memory.peak`) is recorded in
place: its output reuses the operand that died.
"""

from __future__ import annotations

import itertools

from torch.distributed._tools import mem_tracker

from actune.memory.gpu_model import BLAS_OPS, StepTrace
from actune.memory.gpu_temporaries import temporary_bytes

_ADD, _DEL, _SIZE = (mem_tracker._UpdateType.ADD, mem_tracker._UpdateType.DEL,
                     mem_tracker._UpdateType.SIZE)


#: the recorder of the step being estimated, if any (see :func:`note_empty_cache`)
_ACTIVE: list[TraceRecorder] = []


def note_empty_cache() -> None:
    """Where a real step calls ``torch.cuda.empty_cache()`` (L5 after each compressed
    forward), an estimate calls this: the GPU model releases the allocator's cache there."""
    if _ACTIVE:
        _ACTIVE[-1].trace.events.append(("empty_cache",))


class TraceRecorder:
    """Fed by the tracker: storage updates, ops, gradient sums."""

    def __init__(self) -> None:
        self.trace = StepTrace()
        # each tracked storage's key in the trace, by its record's id (ids are reused once a
        # record dies; keys never are)
        self._keys: dict[int, int] = {}
        self._serial = itertools.count()
        self._temporaries = itertools.count(-1, -1)  # keys of op-inner temporaries
        self._open: int | None = None  # the running op's temporary, if any
        self._sum: tuple | None = None  # (operand weak refs, operand keys, output keys)
        self._sum_mark = 0

    def start_step(self) -> None:
        """What is recorded from now on is the step (before: what exists before it); until
        :meth:`end_step`, :func:`note_empty_cache` notes here."""
        self.trace.prefix = len(self.trace.events)
        _ACTIVE.append(self)

    def end_step(self) -> None:
        if self in _ACTIVE:
            _ACTIVE.remove(self)

    def on_update(self, u_type, winfo) -> None:
        if winfo.device.type == "meta":  # (simulated host memory: not the GPU's)
            return
        events = self.trace.events
        if u_type is _ADD:
            key = self._keys[id(winfo)] = next(self._serial)
            events.append(("alloc", key, winfo.mem_consumed))
        elif u_type is _DEL:
            key = self._keys.pop(id(winfo), None)
            if key is not None:
                events.append(("free", key))
        elif u_type is _SIZE and id(winfo) in self._keys:
            old, key = self._keys[id(winfo)], next(self._serial)
            self._keys[id(winfo)] = key
            events.extend((("free", old), ("alloc", key, winfo.mem_consumed)))

    def before_op(self, func, args) -> None:
        self.judge_sum()
        name = func.name() if hasattr(func, "name") else ""
        if name in BLAS_OPS:
            self.trace.uses_blas = True
        nbytes = temporary_bytes(func, args)
        if nbytes:
            self._open = next(self._temporaries)
            self.trace.events.append(("alloc", self._open, nbytes))

    def after_op(self) -> None:
        if self._open is not None:
            self.trace.events.append(("free", self._open))
            self._open = None

    def sum_started(self) -> None:
        self._sum_mark = len(self.trace.events)

    def sum_finished(self, operand_refs: list, operand_ids: list[int | None],
                     out_id: int | None) -> None:
        outs = [e[1] for e in self.trace.events[self._sum_mark:] if e[0] == "alloc"]
        keys = [self._keys.get(i) if i is not None else None for i in operand_ids]
        self._sum = ((operand_refs, keys, outs[0], out_id)
                     if len(outs) == 1 and out_id in self._keys else None)

    def judge_sum(self) -> None:
        """A gradient sum whose operand died before the next op: a plain step adds in place
        into that operand, so its output is no new allocation."""
        if self._sum is None:
            return
        refs, keys, out, out_id = self._sum
        self._sum = None
        dead = [k for r, k in zip(refs, keys, strict=True) if r.expired() and k is not None]
        if not dead or self._keys.get(out_id) != out:
            return
        events = self.trace.events
        operand = dead[0]
        for at in range(len(events) - 1, -1, -1):
            if events[at][0] == "alloc" and events[at][1] == out:
                del events[at]
                break
        for at in range(len(events) - 1, -1, -1):
            if events[at] == ("free", operand):
                del events[at]
                break
        self._keys[out_id] = operand  # its free frees the operand's block
