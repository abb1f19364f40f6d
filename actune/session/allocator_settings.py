"""The CUDA caching allocator's settings a level turns on at run time.

L5 (``Level.defrag``) promises a step the allocator cannot fragment: PyTorch's expandable
segments (one segment per pool that grows by pages, whose free pages ``empty_cache`` unmaps),
turned on from inside the process where the user's ``PYTORCH_CUDA_ALLOC_CONF`` (or
``PYTORCH_ALLOC_CONF``) says nothing of them. The setting applies to segments created after
it; L5 also empties the cache between forward and backward, which releases the older ones.
The GPU model (:mod:`actune.memory.gpu_model`) replays an L5 step under the same setting.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = ["enable_expandable_segments", "user_sets_expandable_segments"]

_KEY = "expandable_segments"
_enabled: list[bool] = []  # (once per process)


def user_sets_expandable_segments(env: Mapping[str, str] | None = None) -> bool:
    """Does the allocator configuration in ``env`` (this process's by default) set
    ``expandable_segments`` either way? Then a level leaves it as the user chose."""
    env = os.environ if env is None else env
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        items = (part.strip() for part in (env.get(name) or "").split(","))
        if any(item.partition(":")[0] == _KEY for item in items):
            return True
    return False


def enable_expandable_segments() -> bool:
    """Turn expandable segments on for this process's CUDA allocator, once, unless the user
    configured them; returns whether this call or an earlier one turned them on."""
    if _enabled:
        return True
    if user_sets_expandable_segments():
        return False
    import torch

    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None:  # (torch before 2.9)
        setter = torch.cuda.memory._set_allocator_settings
    setter(f"{_KEY}:True")
    _enabled.append(True)
    return True
