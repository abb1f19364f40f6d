"""The allocator-level peak of a call on the CPU, compiled code included.

``torch.profiler`` with ``profile_memory`` records every allocation and free made through
PyTorch's CPU allocator (eager ops, and the buffers of Inductor's compiled kernels, which a
tensor tracker does not see); summed in time order, their high-water mark is the call's peak
above what was held when it started.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator

from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

__all__ = ["allocation_peak"]


@contextlib.contextmanager
def _stderr_closed() -> Iterator[None]:
    """File descriptor 2 on the null device (the profiler's C++ side prints a line as it
    starts and one as it stops)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def allocation_peak(fn: Callable[[], object], quiet: bool = False) -> int:
    """Bytes: the highest sum of live allocations made during ``fn()`` (the profiler's view).
    ``quiet``: without the profiler's own lines on stderr (a command's output)."""
    with _stderr_closed() if quiet else contextlib.nullcontext(), \
            profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        if e.tag == _EventType.Allocation:
            events.append((e.start_time_ns, e.extra_fields.alloc_size))
        stack.extend(e.children)
    now = best = 0
    for _, size in sorted(events):
        now += size
        best = max(best, now)
    return best
