"""What a training step takes on a GPU, predicted on any machine: the estimate's trace of
allocations and frees, plus cuBLAS's workspaces and ops' inner temporaries, replayed through
the caching allocator's rules. Gives ``max_memory_allocated`` and ``max_memory_reserved``,
and what NVML shows beyond them (the CUDA context, NCCL's buffers).

The trace comes from :class:`actune.memory.peak.StepMeter` (one steady-state step under fake
tensors); see docs/tuning.md, "On which GPU", for what is derived and what is fitted.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from actune.memory.cuda_allocator import AllocatorConfig, replay
from actune.memory.gpu_profiles import (
    DeviceProfile,
    cublas_workspace_bytes,
    cublaslt_workspace_bytes,
)
from actune.session.allocator_settings import user_sets_expandable_segments

#: ops that run through cuBLAS (a step with any of them holds cuBLAS workspaces)
BLAS_OPS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm",
                      "aten::addbmm", "aten::_scaled_mm", "aten::addmv", "aten::mv"})

#: cuBLAS handles are per thread: forward and the optimizer run on the main thread,
#: backward on autograd's device thread (torch/csrc/autograd/engine.cpp)
BLAS_THREADS = 2


@dataclass
class StepTrace:
    """One step's allocation events (``("alloc", key, bytes)`` / ``("free", key)``); the
    first ``prefix`` exist before the step (parameters, buffers, optimizer state)."""

    events: list = field(default_factory=list)
    prefix: int = 0
    uses_blas: bool = False


@dataclass(frozen=True)
class GpuPeak:
    """A step's predicted peaks on a GPU."""

    allocated: int  # max_memory_allocated
    reserved: int  # max_memory_reserved
    workspaces: int  # cuBLAS (and cuBLASLt) workspaces, inside ``allocated``
    out_of_memory: bool = False  # the replay ran out of ``capacity``


@dataclass(frozen=True)
class GpuModel:
    """A GPU kind and the allocator settings the run will use."""

    profile: DeviceProfile
    allocator: AllocatorConfig = field(default_factory=AllocatorConfig)
    capacity: int | None = None  # what PyTorch may reserve (the budget); None: unlimited
    env: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))

    @classmethod
    def for_profile(cls, profile: DeviceProfile, capacity: int | None = None) -> GpuModel:
        """The model under this process's ``PYTORCH_CUDA_ALLOC_CONF`` and cuBLAS settings."""
        conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get(
            "PYTORCH_ALLOC_CONF")
        return cls(profile, AllocatorConfig.parse(conf), capacity)

    def defragmenting(self) -> GpuModel:
        """The model of an L5 run (``Level.defrag``): expandable segments on, as the level
        turns them on, unless the user's configuration in ``env`` sets them either way
        (:mod:`actune.session.allocator_settings`)."""
        if self.allocator.expandable_segments or user_sets_expandable_segments(self.env):
            return self
        return replace(self, allocator=replace(self.allocator, expandable_segments=True))

    def workspace_bytes(self) -> int:
        """One handle's cuBLAS workspace plus cuBLASLt's, if separate."""
        return (cublas_workspace_bytes(self.profile.capability, self.env)
                + cublaslt_workspace_bytes(self.env))

    def predict(self, trace: StepTrace) -> GpuPeak:
        """The steady-state step's peaks (the replay's second pass, see
        :func:`actune.memory.cuda_allocator.replay`)."""
        workspaces = []
        if trace.uses_blas:
            each = self.workspace_bytes()
            workspaces = [("alloc", ("cublas workspace", i), each) for i in range(BLAS_THREADS)]
        # what exists before the step, largest first (the order it was tracked in is a set's)
        prefix = sorted(trace.events[:trace.prefix], key=lambda e: -e[2] if e[0] == "alloc"
                        else 0)
        events = prefix + workspaces + trace.events[trace.prefix:]
        result = replay(events, self.allocator, self.capacity,
                        warm_prefix=trace.prefix + len(workspaces))
        return GpuPeak(result.allocated, result.reserved,
                       sum(e[2] for e in workspaces), result.out_of_memory)
