"""Is this exception an out-of-memory error? A pure predicate: catch narrowly, re-raise."""

from __future__ import annotations

import torch

_MESSAGES = ("out of memory", "can't allocate memory", "cuda error: out of memory",
             "cublas_status_alloc_failed", "cudnn_status_alloc_failed")


def is_oom(err: BaseException) -> bool:
    """True for torch's OutOfMemoryError and the allocator messages that mean the same."""
    if isinstance(err, torch.OutOfMemoryError):
        return True
    if isinstance(err, RuntimeError | MemoryError):
        text = str(err).lower()
        return isinstance(err, MemoryError) or any(m in text for m in _MESSAGES)
    return False
