"""GPU kinds an estimate can target without the GPU at hand (``--device-profile NAME``), and
the memory CUDA libraries take on them outside tensors.

Each profile's figures and where they come from:

* ``memory``: the device total NVML reports (nvidia-smi's "Total"): the H200's measured on
  the project's one H200 run; the others as their vendors' data sheets and nvidia-smi print
  them.
* ``context``: what the CUDA context takes before PyTorch allocates anything (NVML "used"),
  with lazy module loading: a bound of the 300-500 MiB range reported for recent drivers,
  larger on newer architectures. **Not calibrated on each kind** (no such measurement yet).
* ``nccl_channels``: NCCL's default channels on that interconnect, for the buffers of a
  multi-GPU run (``NCCL_BUFFSIZE``, 4 MiB by default, per channel, send and receive, to each
  of a ring's two neighbours): a bound from NCCL's defaults, not measured.

cuBLAS's workspace follows ``aten/src/ATen/cuda/CublasHandlePool.cpp``: ``:4096:2:16:8``
(8 MiB + 128 KiB) by default, 32 MiB (``:4096:8``) on compute capability 9.x-12.x, or what
``CUBLAS_WORKSPACE_CONFIG`` says; one per cuBLAS handle and stream, allocated through the
caching allocator and kept. cuBLASLt shares it unless ``TORCH_CUBLASLT_UNIFIED_WORKSPACE=0``
(then ``CUBLASLT_WORKSPACE_SIZE`` KiB more, 1,024 by default).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

MIB, GIB = 2**20, 2**30


@dataclass(frozen=True)
class DeviceProfile:
    """One GPU kind: what it holds and what CUDA takes on it outside PyTorch's tensors."""

    name: str  # what --device-profile takes
    title: str
    memory: int  # NVML total, bytes
    capability: tuple[int, int]  # compute capability
    context: int  # CUDA context and loaded modules (a bound)
    nccl_channels: int = 2
    nvml_names: tuple[str, ...] = ()  # substrings of NVML's device name that mean this kind

    def nccl_bytes(self, world_size: int) -> int:
        """NCCL's buffers for a data-parallel run of ``world_size`` ranks (0 alone)."""
        if world_size <= 1:
            return 0
        buffsize = int(os.environ.get("NCCL_BUFFSIZE", 4 * MIB))
        return 2 * 2 * self.nccl_channels * buffsize  # send + receive, two ring neighbours

    def describe(self) -> str:
        major, minor = self.capability
        return f"{self.title} ({self.memory / GIB:.1f} GiB, compute {major}.{minor})"


PROFILES: dict[str, DeviceProfile] = {p.name: p for p in (
    DeviceProfile("h200", "NVIDIA H200", 143_771 * MIB, (9, 0), 512 * MIB, 16, ("H200",)),
    DeviceProfile("h100", "NVIDIA H100 80GB", 81_559 * MIB, (9, 0), 512 * MIB, 16,
                  ("H100",)),
    DeviceProfile("a100-80", "NVIDIA A100 80GB", 81_920 * MIB, (8, 0), 448 * MIB, 16,
                  ("A100-SXM4-80GB", "A100 80GB", "A100-PCIE-80GB")),
    DeviceProfile("a100-40", "NVIDIA A100 40GB", 40_960 * MIB, (8, 0), 448 * MIB, 16,
                  ("A100-SXM4-40GB", "A100-PCIE-40GB", "A100")),
    DeviceProfile("l40s", "NVIDIA L40S", 46_068 * MIB, (8, 9), 448 * MIB, 2, ("L40S",)),
    DeviceProfile("l4", "NVIDIA L4", 23_034 * MIB, (8, 9), 448 * MIB, 2, ("L4",)),
    DeviceProfile("a10g", "NVIDIA A10G", 23_028 * MIB, (8, 6), 448 * MIB, 2, ("A10G",)),
    DeviceProfile("rtx4090", "NVIDIA GeForce RTX 4090", 24_564 * MIB, (8, 9), 448 * MIB, 2,
                  ("RTX 4090",)),
    DeviceProfile("t4", "NVIDIA T4", 15_360 * MIB, (7, 5), 320 * MIB, 2, ("T4",)),
    DeviceProfile("v100", "NVIDIA V100 16GB", 16_384 * MIB, (7, 0), 320 * MIB, 8, ("V100",)),
)}


def find_profile(name: str) -> DeviceProfile:
    """The profile called ``name`` (case-insensitive); ``ValueError`` listing them if none."""
    profile = PROFILES.get(name.strip().lower())
    if profile is None:
        raise ValueError(f"no device profile {name!r}; choose one of "
                         f"{', '.join(PROFILES)} (`actune info` lists them)")
    return profile


def profile_for(nvml_name: str) -> DeviceProfile | None:
    """The profile of a GPU NVML names (``"NVIDIA H100 80GB HBM3"`` -> h100), if known."""
    for profile in PROFILES.values():  # (more specific names come first in the table)
        if any(part in nvml_name for part in profile.nvml_names):
            return profile
    return None


def profile_of(nvml_name: str, memory: int, capability: tuple[int, int]) -> DeviceProfile:
    """The profile of the GPU at hand: its kind's, else one made from what CUDA reports (a
    512 MiB context, the bound of the newest kinds)."""
    return profile_for(nvml_name) or DeviceProfile("found", nvml_name, memory, capability,
                                                   512 * MIB)


def cublas_workspace_bytes(capability: tuple[int, int],
                           env: Mapping[str, str] | None = None) -> int:
    """One cuBLAS handle's workspace on a device of ``capability`` (CublasHandlePool.cpp)."""
    env = os.environ if env is None else env
    config = env.get("CUBLAS_WORKSPACE_CONFIG")
    if config:
        pairs = re.findall(r":([0-9]+):([0-9]+)", config)
        if pairs:
            return sum(int(size) * 1024 * int(count) for size, count in pairs)
    if 9 <= capability[0] <= 12:
        return 4096 * 8 * 1024
    return 4096 * 1024 * 2 + 16 * 1024 * 8


def cublaslt_workspace_bytes(env: Mapping[str, str] | None = None) -> int:
    """cuBLASLt's own workspace per handle: 0 where it shares cuBLAS's (the default)."""
    env = os.environ if env is None else env
    if env.get("TORCH_CUBLASLT_UNIFIED_WORKSPACE", "1").lower() not in ("0", "false"):
        return 0
    return int(env.get("CUBLASLT_WORKSPACE_SIZE", "1024")) * 1024
