"""Memory budgets: ``16GiB``, ``1500MB``, ``80%`` of the device, or the default."""

from __future__ import annotations

import re
from dataclasses import dataclass

from actune import tunables
from actune.memory.gpu_profiles import DeviceProfile
from actune.memory.nvml import DeviceInfo

#: The budget used when there is no GPU to ask (a common 16 GiB card).
SIMULATED_BUDGET = 16 * 2**30


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "k": 2**10, "m": 2**20,
          "g": 2**30, "t": 2**40, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


@dataclass(frozen=True)
class Budget:
    """Bytes a training step may use on the device, and where the figure came from."""

    bytes: int
    source: str


def parse_budget(text: str | None, device: DeviceInfo, profile: DeviceProfile | None = None,
                 world_size: int = 1) -> Budget:
    """The budget for ``text`` (None: the default for ``device``, or for ``profile``: its
    memory less the CUDA context and, for several ranks, NCCL's buffers; percentages are of
    the profile's memory).

    Raises ``ValueError`` with what to write instead for unreadable text.
    """
    if profile is not None and (text is None or text.strip().endswith("%")):
        return _profile_budget(text, profile, world_size, device)
    if text is None:
        if device.available:
            return Budget(max(device.free - tunables.GPU_RESERVE, 0),
                          f"NVML free memory of {device.name} less a "
                          f"{tunables.GPU_RESERVE / 2**30:.1f} GiB reserve")
        return Budget(SIMULATED_BUDGET, "simulated 16 GiB device (no GPU found; set --budget)")
    s = text.strip().lower().replace(" ", "")
    if s.endswith("%"):
        try:
            share = float(s[:-1])
        except ValueError:
            share = -1.0
        if not 0 < share <= 100:
            raise ValueError(f"budget {text!r}: a percentage must be in (0, 100], like 80%")
        total = device.total if device.available else SIMULATED_BUDGET
        where = device.name if device.available else "the simulated 16 GiB device"
        return Budget(int(total * share / 100), f"{share:g}% of {where}")
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([a-z]*)", s)
    if not m or m.group(2) not in _UNITS:
        raise ValueError(f"budget {text!r} is not a size; write e.g. 16GiB, 1500MB or 80%")
    value = int(float(m.group(1)) * _UNITS[m.group(2)])
    if value <= 0:
        raise ValueError(f"budget {text!r} must be more than 0 bytes")
    return Budget(value, "given with --budget")


def _profile_budget(text: str | None, profile: DeviceProfile, world_size: int,
                    device: DeviceInfo) -> Budget:
    """A GPU kind's budget: what it has (NVML's free memory on the GPU at hand, else the
    profile's total) less what CUDA takes outside PyTorch's allocator."""
    extra = profile.context + profile.nccl_bytes(world_size)
    what = "CUDA context" + (" and NCCL buffers" if world_size > 1 else "")
    here = device.available
    usable = max((device.free if here else profile.memory) - extra, 0)
    if text is None:
        has = (f"NVML free memory of {device.name}" if here
               else f"{profile.name} profile: {profile.memory / 2**30:.1f} GiB")
        return Budget(usable, f"{has} less {extra / 2**30:.2f} GiB of {what}")
    share = parse_budget(text, DeviceInfo(True, profile.title, usable, usable)).bytes / usable
    return Budget(int(usable * share), f"{share:.0%} of the {profile.name} profile's "
                                       f"{usable / 2**30:.1f} GiB after its {what}")
