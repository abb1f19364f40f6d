"""The caching allocator simulator against cases worked by hand from the rules of
c10/cuda/CUDACachingAllocator.cpp (rounding, pools, splitting, best fit, merging, release,
max_split_size, expandable segments), and its replay of a step."""

import random

import pytest

from actune.memory.cuda_allocator import (
    AllocatorConfig,
    CachingAllocator,
    SimulatedOutOfMemoryError,
    replay,
    round_size,
    segment_size,
)

KIB, MIB = 2**10, 2**20


@pytest.mark.parametrize("nbytes, rounded", [(1, 512), (512, 512), (513, 1024),
                                             (1_000_000, 1_000_448)])
def test_requests_round_up_to_512_bytes(nbytes, rounded):
    assert round_size(nbytes) == rounded


@pytest.mark.parametrize("size, segment", [(512, 2 * MIB), (MIB, 2 * MIB),
                                           (MIB + 512, 20 * MIB), (10 * MIB - 512, 20 * MIB),
                                           (10 * MIB, 10 * MIB), (11 * MIB + 1, 12 * MIB)])
def test_segments_by_pool(size, segment):
    assert segment_size(size) == segment


def test_small_requests_share_a_2_mib_segment():
    a = CachingAllocator()
    blocks = [a.malloc(100 * KIB) for _ in range(20)]  # 20 x 100 KiB in one 2 MiB segment
    assert a.reserved == 2 * MIB and a.allocated == 20 * 100 * KIB
    a.malloc(100 * KIB)  # 48 KiB left: a second segment
    assert a.reserved == 4 * MIB
    for b in blocks:
        a.free(b)
    assert a.allocated == 100 * KIB


def test_a_large_rest_is_split_off_and_a_small_one_counts_as_allocated():
    a = CachingAllocator()
    first = a.malloc(3 * MIB)  # a 20 MiB segment, split: 17 MiB free
    assert (a.allocated, a.reserved) == (3 * MIB, 20 * MIB)
    second = a.malloc(16 * MIB + 512 * KIB)  # best fit: the 17 MiB rest; 0.5 MiB would
    assert a.allocated == 20 * MIB  # remain (not more than 1 MiB): not split, all allocated
    assert a.reserved == 20 * MIB
    a.free(second)
    a.free(first)  # merged back into one free 20 MiB block
    big = a.malloc(20 * MIB)
    assert a.reserved == 20 * MIB and big.size == 20 * MIB


def test_best_fit_takes_the_smallest_free_block_that_holds_the_request():
    a = CachingAllocator()
    x, y = a.malloc(30 * MIB), a.malloc(12 * MIB)  # two segments of their own sizes
    a.free(x)
    a.free(y)
    z = a.malloc(11 * MIB)  # fits both; the 12 MiB block is the best fit (rest 1 MiB: kept)
    assert z.size == 12 * MIB and a.reserved == 42 * MIB


def test_out_of_memory_releases_unused_segments_first():
    a = CachingAllocator(capacity=50 * MIB)
    x = a.malloc(30 * MIB)
    a.free(x)  # cached, not returned
    y = a.malloc(40 * MIB)  # 30 + 40 > 50: the cached 30 MiB segment is released, then fits
    assert a.reserved == 40 * MIB and a.peak_reserved == 40 * MIB
    with pytest.raises(SimulatedOutOfMemoryError):
        a.malloc(12 * MIB)
    a.free(y)


def test_max_split_size_keeps_oversize_blocks_for_requests_near_their_size():
    a = CachingAllocator(AllocatorConfig(max_split_size=64 * MIB))
    big = a.malloc(100 * MIB)
    a.free(big)
    a.malloc(20 * MIB)  # below max_split_size: the 100 MiB block may not serve it
    assert a.reserved == 120 * MIB
    a.malloc(90 * MIB)  # at or above it, within 20 MiB of the block: served, not split
    assert a.reserved == 120 * MIB and a.allocated == 120 * MIB


def test_expandable_segments_grow_by_pages_and_refill_unmapped_holes():
    a = CachingAllocator(AllocatorConfig(expandable_segments=True))
    x = a.malloc(30 * MIB)
    assert a.reserved == 40 * MIB  # two 20 MiB pages of the large pool
    a.malloc(5 * MIB)  # in the mapped rest
    assert a.reserved == 40 * MIB
    a.malloc(50 * MIB)  # 5 MiB free at the end + 3 more pages
    assert (a.allocated, a.reserved) == (85 * MIB, 100 * MIB)
    a.free(x)
    a.empty_cache()  # x's whole free page [0, 20) is unmapped, [20, 30) stays mapped
    assert a.reserved == 80 * MIB
    a.malloc(25 * MIB)  # the hole: one page mapped again, at the lowest address
    assert (a.allocated, a.reserved) == (80 * MIB, 100 * MIB)


@pytest.mark.parametrize("config", [AllocatorConfig(), AllocatorConfig(expandable_segments=True),
                                    AllocatorConfig(max_split_size=64 * MIB)],
                         ids=["default", "expandable", "max_split"])
def test_random_traffic_keeps_the_books(config):
    rng = random.Random(0)
    a, live = CachingAllocator(config), []
    for i in range(4000):
        if live and rng.random() < 0.5:
            a.free(live.pop(rng.randrange(len(live))))
        else:
            live.append(a.malloc(rng.choice([100, 5000, 2 * MIB, 7 * MIB, 33 * MIB])))
        assert a.allocated == sum(b.size for b in live) <= a.reserved <= a.peak_reserved
        if i % 500 == 0:
            a.empty_cache()
    for b in live:
        a.free(b)
    a.empty_cache()
    assert a.allocated == 0 and a.reserved == 0


@pytest.mark.parametrize("text, expected", [
    ("expandable_segments:True", AllocatorConfig(expandable_segments=True)),
    ("max_split_size_mb:128,expandable_segments:False", AllocatorConfig(False, 128 * MIB)),
    ("garbage_collection_threshold:0.6", AllocatorConfig()), (None, AllocatorConfig())])
def test_the_allocator_settings_parse(text, expected):
    assert AllocatorConfig.parse(text) == expected


def test_bad_allocator_settings_say_what_to_write():
    with pytest.raises(ValueError, match="True or False"):
        AllocatorConfig.parse("expandable_segments:yes")


def test_replay_reports_the_steady_state_after_a_first_step():
    prefix = [("alloc", "w", 4 * MIB)]
    step = [("alloc", "a", 30 * MIB), ("alloc", "g", 4 * MIB), ("free", "a")]
    # first pass: w (20 MiB segment), a (30 MiB), g in w's segment; g survives the step and
    # is freed before the second, which reuses the cached segments: nothing new reserved
    result = replay(prefix + step, warm_prefix=1)
    assert result.allocated == 38 * MIB and result.reserved == 50 * MIB
    assert not result.out_of_memory
    assert replay(prefix + step, capacity=40 * MIB, warm_prefix=1).out_of_memory
