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
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from unittest import mock

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools import mem_tracker

from actune.memory.gpu_model import GpuModel, StepTrace
from actune.memory.trace import TraceRecorder
from actune.memory.tracker import PeakTracker
from actune.packing.saved import simulated_offload
from actune.session.hooks import CompressionStats

#: torch's ModTracker's warnings under checkpointing (see StepMeter.peak)
_TRACKER_WARNINGS = ("The module hierarchy tracking maybe be messed up",
                     "Module is None. Skipping")


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
        self.last_trace: StepTrace | None = None  # the last such step's trace
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
                tracker = PeakTracker()
                if self.gpu is not None:  # (before: tracking records what exists already)
                    tracker.recorder = TraceRecorder()
                tracker.track_external(self.model, self.opt)
                with rounding, tracker, warnings.catch_warnings():
                    # a checkpointed block's recomputation enters its modules' forward again
                    # inside backward, which torch's ModTracker reports as a broken hierarchy
                    # (a warning a step; the bytes are counted by dispatch, not by it)
                    for message in _TRACKER_WARNINGS:
                        warnings.filterwarnings("ignore", message, UserWarning)
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
                self.last_trace = tracker.recorder.trace
                result = _on_gpu(result, self.gpu, self.last_trace, batch)
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
        tracker = PeakTracker()
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
