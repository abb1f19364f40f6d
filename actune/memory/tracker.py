"""The memory tracker behind every peak (:mod:`actune.memory.peak`): torch's MemTracker keeping
only the whole step's peak and where it was, counting autograd's gradient sums as a plain step
does them, and feeding a :class:`~actune.memory.trace.TraceRecorder` for the GPU model."""

from __future__ import annotations

import sys

import torch
from torch.distributed._tools import mem_tracker
from torch.distributed._tools.mem_tracker import MemTracker
from torch.multiprocessing.reductions import StorageWeakRef

from actune.memory.trace import TraceRecorder
from actune.substitutes.lazy_logits import LazyLogits


class _NoHook:
    def remove(self) -> None:
        pass


_NO_HOOKS = (_NoHook(), _NoHook())


class PeakTracker(MemTracker):
    """MemTracker keeping only the whole step's peak (with its split by category) and where
    in the step it happened.

    MemTracker also keeps every module's own peak, updated with a pass over all modules at
    every operation: quadratic in depth (33.8 of 42.7 s for a 2x-deep ResNet-152 step). The
    per-module figures are not used here.
    """

    def __init__(self) -> None:
        super().__init__()
        self.where: dict[torch.device, str] = {}
        # an out-of-place gradient sum waiting to be judged: (its operands, the peak candidate)
        self._sum: tuple[list[StorageWeakRef], dict] | None = None
        self._summing: tuple | None = None  # the operands of a gradient sum being run
        # module name -> (when it last began, forward or backward; its class's name)
        self._entered: dict[str, tuple[int, str]] = {}
        self._clock = 0
        self.recorder: TraceRecorder | None = None  # set to record the GPU model's trace

    def _update_snap(self, u_type, winfo, old_mem_consumed=None, old_reftype=None) -> None:
        super()._update_snap(u_type, winfo, old_mem_consumed, old_reftype)
        if self.recorder is not None:
            self.recorder.on_update(u_type, winfo)

    # MemTracker's module hooks copy a whole snapshot, and size each module's inputs and
    # outputs, four times per module and step, for per-module figures this class does not
    # keep: only the step's peak is read ("peak" snapshot).

    def get_tracker_snapshot(self, type: str = "current"):  # MemTracker names it so
        return {} if type == "current" else super().get_tracker_snapshot(type)

    def _track_inputs_or_outputs(self, args) -> int:
        return 0

    def _track(self, reftype, t: torch.Tensor) -> None:
        if type(t) is LazyLogits:
            return  # no storage of its own: logits a loss will compute in chunks
        super()._track(reftype, t)

    def _track_module_params_and_buffers(self, module, install_grad_hooks: bool = True):
        # MemTracker would put gradient hooks on every parameter, and a frozen one (LoRA's
        # base weights) refuses them: it is marked as hooked for the call, and has no gradient
        frozen = [p for p in module.parameters() if not p.requires_grad
                  and p not in self._param_to_grad_hook_handles]
        for p in frozen:
            self._param_to_grad_hook_handles[p] = _NO_HOOKS
        try:
            return super()._track_module_params_and_buffers(module, install_grad_hooks)
        finally:
            for p in frozen:
                self._param_to_grad_hook_handles.pop(p, None)

    def _pre_fw_hook(self, module, inputs) -> None:
        self._enter(module)
        super()._pre_fw_hook(module, inputs)

    def _pre_bw_hook(self, module, args) -> None:
        if module is None:  # (the module's weak reference died: BERT's classifier head)
            return
        self._enter(module)
        super()._pre_bw_hook(module, args)

    def _enter(self, module) -> None:
        name = self._mod_tracker.get_known_fqn(module)
        if name is not None:
            self._clock += 1
            self._entered[name] = (self._clock, type(module).__name__)

    # Autograd sums two gradients of one tensor in place when it holds the last reference to
    # one of them, except under a TorchDispatchMode (this tracker is one), where it always adds
    # out of place. Such a sum's output is counted as a peak only if neither operand is freed
    # before the next operation, i.e. only where a plain run would have allocated it too.

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.recorder is None:
            return self._dispatch(func, types, args, kwargs)
        self.recorder.before_op(func, args)
        try:
            return self._dispatch(func, types, args, kwargs)
        finally:
            self.recorder.after_op()

    def _dispatch(self, func, types, args, kwargs):
        self._judge_sum()
        if func is _DEVICE:  # fake tensors' device queries (the autograd engine's, many of
            return func(*args)  # an estimate's operations) allocate nothing: no bookkeeping
        if func.is_view and mem_tracker.DTensor not in types:  # a view of tracked storage
            out = func(*args, **(kwargs or {}))  # changes no count: no bookkeeping either
            if self._tracked(out):
                return out
        if (func is torch.ops.aten.add.Tensor and not kwargs and self._mod_tracker.is_bw
                and not self._in_opt and _is_gradient_sum(args)):
            self._summing = args[:2]
            if self.recorder is not None:
                self.recorder.sum_started()
            try:
                out = super().__torch_dispatch__(func, types, args, kwargs)
            finally:
                self._summing = None
            if self.recorder is not None:
                self._record_sum(args[:2], out)
            return out
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _record_sum(self, operands, out) -> None:
        """Tell the recorder which storages a gradient sum read and wrote (by their records)."""
        def record_id(t):
            found = self._WINFO.get(t.untyped_storage())
            return id(found[0]) if found else None

        self.recorder.sum_finished([StorageWeakRef(a.untyped_storage()) for a in operands],
                                   [record_id(a) for a in operands], record_id(out))

    def _tracked(self, out) -> bool:
        """Are the storages of ``out`` (a tensor or a sequence of them) all counted already?"""
        tensors = out if isinstance(out, list | tuple) else (out,)
        return all(isinstance(t, torch.Tensor) and t.untyped_storage() in self._WINFO
                   for t in tensors)

    def __exit__(self, *args):
        self._judge_sum()
        if self.recorder is not None:
            self.recorder.judge_sum()
        return super().__exit__(*args)

    def _judge_sum(self) -> None:
        if self._sum is None:
            return
        operands, candidates = self._sum
        self._sum = None
        if not any(ref.expired() for ref in operands):
            self._record(candidates)

    def _update_peak_stats(self, peak_state) -> None:
        self._judge_sum()
        candidates = {dev: (dict(snap), self._place(peak_state))
                      for dev, snap in self._curr_mem_snap.items()
                      if self._peak_mem.get(dev, 0) < snap[mem_tracker._TOTAL_KEY]}
        if self._summing is not None and candidates:
            self._sum = ([StorageWeakRef(a.untyped_storage()) for a in self._summing],
                         candidates)
            return
        self._record(candidates)

    def _record(self, candidates: dict) -> None:
        for dev, (snap, where) in candidates.items():
            if self._peak_mem.get(dev, 0) < snap[mem_tracker._TOTAL_KEY]:
                self._peak_mem[dev] = snap[mem_tracker._TOTAL_KEY]
                self._peak_mem_snap[dev] = snap
                self.where[dev] = where

    def _place(self, peak_state) -> str:
        """The phase of the step and the innermost module running (its name in the model)."""
        if self._in_opt:
            return "optimizer step"
        phase = "backward" if peak_state == mem_tracker._ModState.PEAK_BW else "forward"
        running = [name for name in self._mod_tracker.parents if name != "Global"]
        if not running:
            return f"{phase}, outside modules"
        # the module begun last among those still running (in backward a module stays
        # "running" until its inputs' gradients are complete, so depth alone misleads)
        innermost = max(running, key=lambda name: (self._entered.get(name, (0,))[0],
                                                    name.count(".")))
        _root, _, inside = innermost.partition(".")  # names start with the model's class
        kind = self._entered.get(innermost, (0, None))[1]
        return f"{phase}, {inside or innermost}" + (f" ({kind})" if inside and kind else "")


_DEVICE = torch.ops.prim.device.default
_WRAPPERS = ("eval_frame.py", "_compile.py", "_python_dispatch.py", "mem_tracker.py",
             "tracker.py")


def _dense(t: torch.Tensor) -> bool:
    return t.is_contiguous() or t.is_contiguous(memory_format=torch.channels_last)


def _is_gradient_sum(args) -> bool:
    """Is this ``add`` autograd's own sum of two gradients of one tensor (two dense tensors
    alike, issued by the engine itself, not by a backward written in Python)?"""
    if len(args) != 2 or not all(isinstance(a, torch.Tensor) for a in args):
        return False
    a, b = args
    if (a.shape != b.shape or a.dtype != b.dtype or a.device != b.device
            or not (_dense(a) and _dense(b))):
        return False
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.endswith(_WRAPPERS):
        frame = frame.f_back
    return frame is not None and frame.f_code.co_name == "_engine_run_backward"
