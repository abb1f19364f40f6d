"""The peak bytes of one training step, by category, measured or estimated.

One interface, three ways (see docs/tuning.md):

* ``measure`` on a GPU: ``torch.cuda`` statistics (max_memory_allocated after a reset);
* ``measure`` on the CPU: a live-tensor tracker (torch's MemTracker) on real tensors;
* ``estimate``: the same tracker on the same step under ``FakeTensorMode``: shapes and
  allocations without arithmetic, in milliseconds per layer. With ``round_to`` (512 for a
  CUDA target, like the caching allocator) each storage is rounded up.

Offloaded activations (levels L4/L5) are counted as host bytes, not device bytes; in an
estimate their packed buffers are placed on the ``meta`` device to keep them apart.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from unittest import mock

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools import mem_tracker
from torch.distributed._tools.mem_tracker import MemTracker
from torch.multiprocessing.reductions import StorageWeakRef

from actune.hooks import CompressionStats
from actune.memory.gpu_model import GpuModel
from actune.memory.trace import TraceRecorder
from actune.saved import simulated_offload


@dataclass(frozen=True)
class Peak:
    """Peak bytes of a training step on the device, by category, plus host bytes."""

    total: int
    parameters: int
    gradients: int
    optimizer: int
    activations: int  # live activation tensors at the peak
    temporaries: int
    other: int
    saved: int  # bytes held for backward at the end of forward (activations kept)
    saved_uncompressed: int  # what PyTorch would have held
    host: int = 0  # offloaded to host memory (L4/L5), not counted in ``total``
    where: str = ""  # the phase and innermost module at the peak, e.g. "forward, layer1.2.bn3"
    # what stayed exact although compressed levels could pack it: bytes by the op that saved
    # it ("small tensors": those under the level's min_numel)
    kept_exact: dict = field(default_factory=dict)
    # a GPU's reserved peak (predicted by the GPU model, or measured); 0 where not known
    reserved: int = 0

    def as_dict(self) -> dict:
        return asdict(self)

    @property
    def fit_bytes(self) -> int:
        """What must fit the budget: the reserved peak where known, else the allocated."""
        return max(self.total, self.reserved)


class _PeakTracker(MemTracker):
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
        if func is _DEVICE:  # fake tensors' device queries (the autograd engine's, 40% of an
            return func(*args)  # estimate's operations) allocate nothing: no bookkeeping
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
             "peak.py")


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


# A training step: given the model, its optimizer, a batch size and a callback for the
# compression statistics, run forward, backward and the optimizer step.
Step = Callable[[torch.nn.Module, torch.optim.Optimizer, int,
                 Callable[[CompressionStats], None]], None]
BuildModel = Callable[[], tuple[torch.nn.Module, torch.optim.Optimizer]]


class StepMeter:
    """Peaks of training steps of one model at several batch sizes.

    The model and optimizer are built once and warmed up with one step (so optimizer state
    exists: the steady state; ``warm_optimizer_only``, in an estimate: one optimizer step on
    zero gradients, which leaves the same state for a fraction of the operations), then each
    :meth:`peak` tracks one step. ``mode`` is
    ``estimate`` (fake tensors, no arithmetic) or ``measure`` (real tensors on ``device``).
    """

    def __init__(self, build: BuildModel, step: Step, mode: str = "estimate",
                 device: str = "cpu", round_to: int | None = None,
                 warmup_batch: int = 2, warm_optimizer_only: bool = False,
                 gpu: GpuModel | None = None) -> None:
        if mode not in ("estimate", "measure"):
            raise ValueError(f"mode must be 'estimate' or 'measure', not {mode!r}")
        self.build, self.step, self.mode, self.device = build, step, mode, device
        self.round_to, self.warmup_batch = round_to, warmup_batch
        # an estimate for a GPU: the step's trace replayed through its allocator
        self.gpu = gpu if mode == "estimate" else None
        self.warm_optimizer_only = warm_optimizer_only and mode == "estimate"
        self.fake = FakeTensorMode() if mode == "estimate" else None
        self.model = self.opt = None
        self._cache: dict[int, Peak] = {}

    @contextlib.contextmanager
    def _context(self):
        outer = self.fake if self.fake is not None else contextlib.nullcontext()
        offload = simulated_offload() if self.fake is not None else contextlib.nullcontext()
        with outer, _default_device("cpu" if self.fake is not None else self.device), offload:
            yield

    def peak(self, batch: int) -> Peak:
        """Peak of one steady-state step at ``batch`` (remembered per batch)."""
        if batch in self._cache:
            return self._cache[batch]
        if self.mode == "measure" and torch.device(self.device).type == "cuda":
            result = _measure_cuda(self, batch)
        else:
            rounding = _rounding(self.round_to) if self.round_to else contextlib.nullcontext()
            with self._context():
                self._warm()
                stats: list[CompressionStats] = []
                tracker = _PeakTracker()
                if self.gpu is not None:  # (before: tracking records what exists already)
                    tracker.recorder = TraceRecorder()
                tracker.track_external(self.model, self.opt)
                with rounding, tracker:
                    if tracker.recorder is not None:
                        tracker.recorder.start_step()
                    try:
                        self.step(self.model, self.opt, batch, stats.append)
                    finally:
                        if tracker.recorder is not None:
                            tracker.recorder.end_step()
                snap = tracker.get_tracker_snapshot("peak")
            host = sum(v.get(mem_tracker._TOTAL_KEY, 0) for d, v in snap.items()
                       if d.type == "meta")
            dev = [(d, v) for d, v in snap.items() if d.type != "meta"]
            result = _peak(dev[0][1] if dev else {}, stats, host,
                           tracker.where.get(dev[0][0], "") if dev else "")
            if tracker.recorder is not None:
                result = _on_gpu(result, self.gpu, tracker.recorder.trace, batch)
        self._cache[batch] = result
        return result

    def warm(self) -> None:
        """Build the model and optimizer and take the warm-up step now (else the first
        :meth:`peak` does)."""
        with self._context():
            self._warm()

    def _warm(self) -> None:
        if self.model is None:
            self.model, self.opt = self.build()
            if self.warm_optimizer_only:  # fake tensors: the state, without a whole step
                _step_optimizer(self.model, self.opt)
            else:
                self.step(self.model, self.opt, self.warmup_batch, lambda _s: None)


def _on_gpu(peak: Peak, gpu: GpuModel, trace, batch: int) -> Peak:
    """The tracked peak with the GPU model's allocated and reserved peaks in place of the
    sum of tensors; raises ``torch.OutOfMemoryError`` where the replay runs out."""
    predicted = gpu.predict(trace)
    if predicted.out_of_memory:
        raise torch.OutOfMemoryError(
            f"simulated {gpu.profile.name} allocator: batch {batch} ran out of memory "
            f"(capacity {gpu.capacity:,} bytes)")
    return dataclasses.replace(peak, total=predicted.allocated, reserved=predicted.reserved)


def _default_device(device: str):
    """``torch.device(device)`` as the default for new tensors, unless it is the default
    already: the context is a function mode every torch call then passes through (in a deep
    estimate about a tenth of the time, for nothing)."""
    if torch.get_default_device() == torch.device(device):
        return contextlib.nullcontext()
    return torch.device(device)


def _step_optimizer(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    """One optimizer step on zero gradients: the optimizer's state (momentum, Adam's moments)
    exists afterwards as after a training step, and the gradients are gone, as a step's
    ``zero_grad(set_to_none=True)`` leaves them."""
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)


def _measure_cuda(meter: StepMeter, batch: int) -> Peak:  # pragma: no cover - needs a GPU
    device = meter.device
    torch.cuda.synchronize(device)
    with torch.device(device):
        meter._warm()
        torch.cuda.synchronize(device)
        stats: list[CompressionStats] = []
        tracker = _PeakTracker()
        tracker.track_external(meter.model, meter.opt)
        torch.cuda.reset_peak_memory_stats(device)
        with tracker:
            meter.step(meter.model, meter.opt, batch, stats.append)
        torch.cuda.synchronize(device)
        total = torch.cuda.max_memory_allocated(device)
        reserved = torch.cuda.max_memory_reserved(device)
    snap = tracker.get_tracker_snapshot("peak")
    cuda = next((d for d in snap if d.type == "cuda"), None)
    peak = _peak(snap.get(cuda, {}), stats, 0, tracker.where.get(cuda, ""))
    return Peak(**{**peak.as_dict(), "total": total, "reserved": reserved})


def _peak(parts: dict, stats: list[CompressionStats], host: int, where: str = "") -> Peak:
    def get(kind: str) -> int:
        return sum(v for k, v in parts.items() if str(k).endswith(kind))

    held = stats[0] if stats else CompressionStats()
    saved_uncompressed = held.saved_bytes
    saved = held.kept_bytes if held.packed else saved_uncompressed
    return Peak(
        total=parts.get(mem_tracker._TOTAL_KEY, 0),
        parameters=get("PARAM") + get("BUFFER"),
        gradients=get("GRAD"),
        optimizer=get("OPT"),
        activations=get("ACT"),
        temporaries=get("TEMP"),
        other=get("OTH"),
        saved=saved,
        saved_uncompressed=saved_uncompressed,
        host=host,
        where=where,
        kept_exact={**held.exact, **({"small tensors": held.small_bytes} if held.small_bytes
                                      else {})} if held.packed else {},
    )


@contextlib.contextmanager
def _rounding(quantum: int):
    """Round every tracked storage up to ``quantum`` bytes (the CUDA caching allocator's
    smallest block is 512 bytes)."""

    def consumed(self) -> int:
        return math.ceil(self.size * self.element_size / quantum) * quantum

    with mock.patch.object(mem_tracker._WeakRefInfo, "_calculate_mem_consumed", consumed):
        yield
