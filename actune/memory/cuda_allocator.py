"""A simulator of PyTorch's CUDA caching allocator: allocated and reserved bytes, not a sum of
tensor sizes.

It follows the rules of ``c10/cuda/CUDACachingAllocator.cpp`` (one stream, no graph pools):

* every request is rounded up to a multiple of 512 bytes (``kMinBlockSize``);
* requests of 1 MiB or less come from a small pool, packed in 2 MiB segments; larger ones from
  a large pool: 20 MiB segments for requests under 10 MiB, else the request rounded up to
  2 MiB;
* a free block is chosen by best fit (the smallest that holds the request, then the lowest
  address);
* a block is split if the rest would be at least 512 bytes (small pool) or more than 1 MiB
  (large pool, and only for requests under ``max_split_size``); an unsplit rest stays part of
  the allocated block and counts as allocated;
* with ``max_split_size``, blocks of that size or more serve only requests of that size or
  more, and only within 20 MiB of their size;
* freed blocks merge with free neighbours of their segment;
* when a new segment would exceed the capacity, every cached segment with nothing allocated
  is released and the allocation retried, then it is out of memory;
* ``expandable_segments``: one segment per pool that grows by pages (2 MiB small, 20 MiB
  large) at its end, where a free block at the end grows into them.

Not modelled: ``roundup_power2_divisions``, the garbage-collection threshold, several streams
and CUDA graph pools.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable
from dataclasses import dataclass

KIB, MIB = 2**10, 2**20
MIN_BLOCK = 512  # kMinBlockSize
SMALL_SIZE = 1 * MIB  # kSmallSize: the largest small request
SMALL_BUFFER = 2 * MIB  # kSmallBuffer: a small pool's segment
LARGE_BUFFER = 20 * MIB  # kLargeBuffer: a segment for requests of 1-10 MiB
MIN_LARGE_ALLOC = 10 * MIB  # kMinLargeAlloc
ROUND_LARGE = 2 * MIB  # kRoundLarge
UNBOUNDED = 1 << 56  # an expandable segment's unmapped end: more than any device holds


class SimulatedOutOfMemoryError(RuntimeError):
    """The simulated allocator could not serve a request within its capacity."""


@dataclass(frozen=True)
class AllocatorConfig:
    """The settings of ``PYTORCH_CUDA_ALLOC_CONF`` that change where bytes go."""

    expandable_segments: bool = False
    max_split_size: int | None = None  # bytes; None: unlimited (the default)

    @classmethod
    def parse(cls, text: str | None) -> AllocatorConfig:
        """``"expandable_segments:True,max_split_size_mb:128"`` (other keys are ignored);
        raises ``ValueError`` naming what to write for an unreadable value."""
        expandable, split = False, None
        for item in filter(None, (part.strip() for part in (text or "").split(","))):
            key, _, value = item.partition(":")
            if key == "expandable_segments":
                if value not in ("True", "False"):
                    raise ValueError(f"expandable_segments:{value}: write True or False")
                expandable = value == "True"
            elif key == "max_split_size_mb":
                if not value.isdigit() or int(value) <= 1:
                    raise ValueError(f"max_split_size_mb:{value}: write a number of MiB above 1")
                split = int(value) * MIB
        return cls(expandable, split)


def round_size(nbytes: int) -> int:
    """A request's size as the allocator serves it (``round_size``)."""
    return max(MIN_BLOCK, -(-nbytes // MIN_BLOCK) * MIN_BLOCK)


def segment_size(size: int) -> int:
    """The segment a request that finds no free block asks the driver for
    (``get_allocation_size``)."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


class _Block:
    __slots__ = ("addr", "allocated", "expandable", "mapped", "next", "prev", "size", "small")

    def __init__(self, addr: int, size: int, small: bool, expandable: bool = False,
                 mapped: bool = True) -> None:
        self.addr, self.size, self.small, self.expandable = addr, size, small, expandable
        self.mapped = mapped  # (expandable segments: an unmapped range of the address space)
        self.allocated = False
        self.prev: _Block | None = None
        self.next: _Block | None = None

    def key(self) -> tuple[int, int]:
        return (self.size, self.addr)

    def split(self, size: int, mapped: bool = True) -> _Block:
        """Keep the first ``size`` bytes; return the rest as a new block after this one."""
        rest = _Block(self.addr + size, self.size - size, self.small, self.expandable, mapped)
        rest.prev, rest.next = self, self.next
        if self.next is not None:
            self.next.prev = rest
        self.next, self.size = rest, size
        return rest

    def absorb_next(self) -> None:
        """Merge the block after this one into it."""
        other = self.next
        self.size += other.size
        self.next = other.next
        if other.next is not None:
            other.next.prev = self


class CachingAllocator:
    """One device's caching allocator, one stream. ``capacity``: the bytes the driver can give
    (None: unlimited)."""

    def __init__(self, config: AllocatorConfig | None = None,
                 capacity: int | None = None) -> None:
        self.config = config or AllocatorConfig()
        self.capacity = capacity
        self.allocated = self.reserved = 0
        self.peak_allocated = self.peak_reserved = 0
        self._free: dict[bool, list[tuple[int, int]]] = {True: [], False: []}  # sorted keys
        self._by_key: dict[tuple[int, int], _Block] = {}
        self._heads: dict[bool, _Block] = {}  # expandable: each pool's segment's first block
        self._addresses = itertools.count(1 << 40, 1 << 40)  # one address range per segment

    # -- the public interface -------------------------------------------------------------

    def malloc(self, nbytes: int) -> _Block:
        """Serve a request of ``nbytes``; raises :class:`SimulatedOutOfMemoryError`."""
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        block = self._find_free(size, small)
        if block is None:
            block = self._new_block(size, small)
        if block is None:
            self.empty_cache()
            block = self._new_block(size, small)
        if block is None:
            raise SimulatedOutOfMemoryError(
                f"{size:,} bytes requested with {self.reserved:,} reserved of "
                f"{self.capacity:,}")
        if self._should_split(block, size):
            self._insert(block.split(size))
        block.allocated = True
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return block

    def free(self, block: _Block) -> None:
        """Return a block to its pool, merged with its free neighbours."""
        block.allocated = False
        self.allocated -= block.size
        for other in (block.prev, block.next):
            if other is not None and not other.allocated and other.mapped:
                self._remove(other)
                if other is block.prev:
                    other.absorb_next()
                    block = other
                else:
                    block.absorb_next()
        self._insert(block)

    def empty_cache(self) -> None:
        """Release every cached segment with nothing allocated in it (``emptyCache``); with
        expandable segments, unmap every whole free page."""
        for small in (True, False):
            for key in list(self._free[small]):
                block = self._by_key[key]
                if block.expandable:
                    self._unmap_pages(block)
                elif block.prev is None and block.next is None:
                    self._remove(block)
                    self.reserved -= block.size

    def reset_peaks(self) -> None:
        """``torch.cuda.reset_peak_memory_stats``."""
        self.peak_allocated, self.peak_reserved = self.allocated, self.reserved

    # -- internals ------------------------------------------------------------------------

    def _insert(self, block: _Block) -> None:
        key = block.key()
        bisect.insort(self._free[block.small], key)
        self._by_key[key] = block

    def _remove(self, block: _Block) -> None:
        key = block.key()
        pool = self._free[block.small]
        del pool[bisect.bisect_left(pool, key)]
        del self._by_key[key]

    def _find_free(self, size: int, small: bool) -> _Block | None:
        pool = self._free[small]
        at = bisect.bisect_left(pool, (size, -1))
        if at == len(pool):
            return None
        block = self._by_key[pool[at]]
        limit = self.config.max_split_size
        oversize = limit is not None and not small and (
            size < limit <= block.size or (size >= limit and block.size >= size + LARGE_BUFFER))
        if oversize:  # blocks of max_split_size or more serve only requests near their size
            return None
        self._remove(block)
        return block

    def _new_block(self, size: int, small: bool) -> _Block | None:
        if self.config.expandable_segments:
            return self._map(size, small)
        grant = segment_size(size)
        if not self._reserve(grant):
            return None
        return _Block(next(self._addresses), grant, small)

    def _reserve(self, nbytes: int) -> bool:
        if self.capacity is not None and self.reserved + nbytes > self.capacity:
            return False
        self.reserved += nbytes
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return True

    def _map(self, size: int, small: bool) -> _Block | None:
        """Expandable segments: map pages at the lowest address where unmapped space (with
        the free blocks around it) holds ``size``. The segment ends in an unmapped block as
        large as any address space, so a run reaching it always holds ``size``."""
        page = SMALL_BUFFER if small else LARGE_BUFFER
        if small not in self._heads:
            self._heads[small] = _Block(next(self._addresses), UNBOUNDED, small, True, False)
        start = self._heads[small]
        while True:  # the first run of unallocated blocks that holds size with pages mapped
            if start.allocated:
                start = start.next
                continue
            run, after, unmapped = 0, start, False
            while run < size and not after.allocated:
                run, unmapped, after = run + after.size, unmapped or not after.mapped, after.next
            if unmapped and run >= size:
                break
            start = after
        plan, covered = [], 0  # (block, bytes of it to map)
        for b in _chain(start):
            if covered >= size:
                break
            want = b.size if b.mapped else min(b.size, -(-(size - covered) // page) * page)
            plan.append((b, 0 if b.mapped else want))
            covered += want
        if not self._reserve(sum(n for _, n in plan)):
            return None
        for b, n in plan:
            if b.mapped:
                self._remove(b)
            else:
                if n < b.size:
                    b.split(n, mapped=False)
                b.mapped = True
        for _ in plan[1:]:
            start.absorb_next()
        return start

    def _unmap_pages(self, block: _Block) -> None:
        """Unmap the whole pages inside a free block of an expandable segment."""
        page = SMALL_BUFFER if block.small else LARGE_BUFFER
        base = self._heads[block.small].addr  # (pages are counted from the segment's start)
        lo = base + -(-(block.addr - base) // page) * page
        hi = base + (block.addr + block.size - base) // page * page
        if hi <= lo:
            return
        self._remove(block)
        if hi < block.addr + block.size:
            self._insert(block.split(hi - block.addr))
        if lo > block.addr:
            middle = block.split(lo - block.addr)
            self._insert(block)
            block = middle
        block.mapped = False
        self.reserved -= block.size
        if block.next is not None and not block.next.mapped:
            block.absorb_next()
        if block.prev is not None and not block.prev.mapped:
            block.prev.absorb_next()

    def _should_split(self, block: _Block, size: int) -> bool:
        rest = block.size - size
        if block.small or self.config.expandable_segments:
            return rest >= MIN_BLOCK
        limit = self.config.max_split_size
        return (limit is None or size < limit) and rest > SMALL_SIZE


def _chain(block: _Block | None):
    while block is not None:
        yield block
        block = block.next


# An allocation event: ("alloc", key, nbytes), ("free", key) or ("empty_cache",).
Event = tuple


@dataclass(frozen=True)
class Replay:
    """Peaks of a replayed event sequence."""

    allocated: int  # max_memory_allocated
    reserved: int  # max_memory_reserved
    out_of_memory: bool = False


def replay(events: Iterable[Event], config: AllocatorConfig | None = None,
           capacity: int | None = None, warm_prefix: int = 0) -> Replay:
    """Run ``events`` through a fresh allocator, twice after the first ``warm_prefix``
    (what exists before the step: parameters, optimizer state): the second pass starts from
    the first's cached segments, with what the first left allocated freed first (as the next
    step's ``zero_grad`` and rebinding free it), and its peaks are reported: a training
    loop's steady state. Frees of keys never allocated are ignored."""
    events = list(events)
    alloc = CachingAllocator(config, capacity)
    live: dict = {}
    try:
        _run(alloc, events[:warm_prefix], live, None)
        body = events[warm_prefix:]
        persistent = set(live)
        _run(alloc, body, live, 1)
        for key in [k for k in live if k not in persistent]:
            alloc.free(live.pop(key))
        alloc.reset_peaks()
        _run(alloc, body, live, 2)
    except SimulatedOutOfMemoryError:
        return Replay(alloc.peak_allocated, alloc.peak_reserved, True)
    return Replay(alloc.peak_allocated, alloc.peak_reserved)


def _run(alloc: CachingAllocator, events: list[Event], live: dict, tag: int | None) -> None:
    """Replay ``events``; a pass's own allocations are keyed ``(tag, key)``, what exists
    before the step (``tag`` None) by its key alone, which any pass may free."""
    for event in events:
        if event[0] == "empty_cache":
            alloc.empty_cache()
            continue
        key = event[1] if tag is None else (tag, event[1])
        if event[0] == "alloc":
            live[key] = alloc.malloc(event[2])
        else:
            block = live.pop(key, None) or live.pop(event[1], None)
            if block is not None:
                alloc.free(block)
