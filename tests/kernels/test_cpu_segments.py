"""Several tensors in one kernel call: each segment's bytes are the reference's for it alone."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actune_kernels import cpu, cpu_segments, layout
from actune_kernels import reference as ref


def pack_all(parts, widths, zeros, group_size, seed, stochastic=True, dtype=np.float32):
    table = cpu_segments.segment_table([p.size for p in parts], widths, zeros, group_size)
    start, group, codes_at = table[:3]
    x = np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype)
    codes = np.full(int(codes_at[-1]), 0xAA, np.uint8)
    meta = np.full((int(group[-1]), 2), 0xAAAA, np.uint16)
    cpu_segments.pack_segments(x, codes, meta, table, group_size, seed, stochastic)
    y = np.full(x.size, 99, dtype)
    cpu_segments.unpack_segments(codes, meta, table, group_size, y)
    return x, codes, meta, y, (start, group, codes_at)


def assert_each_alone(parts, widths, zeros, group_size=256, seed=11, stochastic=True,
                      dtype=np.float32):
    x, codes, meta, y, (start, group, codes_at) = pack_all(parts, widths, zeros, group_size,
                                                            seed, stochastic, dtype)
    for k, (b, z) in enumerate(zip(widths, zeros, strict=True)):
        seg = x[start[k]:start[k + 1]]
        c_ref, m_ref = ref.pack(seg, b, group_size, seed, stochastic, int(start[k]), z)
        np.testing.assert_array_equal(meta[group[k]:group[k + 1]], m_ref)
        np.testing.assert_array_equal(codes[codes_at[k]:codes_at[k + 1]], c_ref)
        y_ref = ref.unpack(c_ref, m_ref, b, seg.size, group_size, seg.dtype, z)
        np.testing.assert_array_equal(y[start[k]:start[k + 1]].view(np.uint8),
                                      y_ref.view(np.uint8))


def _parts(rng, sizes, zeros):
    return [np.abs(rng.standard_normal(n)) * (rng.random(n) > 0.3) if z
            else rng.standard_normal(n) * 3 + 0.5 for n, z in zip(sizes, zeros, strict=True)]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_mixed_widths_zero_codes_partial_groups_and_empty_segments(dtype):
    rng = np.random.default_rng(3)
    sizes = [300, 0, 1, 256, 513, 0, 7]
    widths = [2, 8, 1, 4, 2, 1, 8]
    zeros = [False, False, False, True, True, False, True]
    assert_each_alone(_parts(rng, sizes, zeros), widths, zeros, dtype=dtype)


def test_one_element_and_nothing_at_all():
    assert_each_alone([np.array([2.5])], [2], [False])
    x, codes, meta, y, _ = pack_all([np.zeros(0)] * 3, [2, 4, 8], [False] * 3, 256, 1)
    assert x.size == codes.size == meta.shape[0] == y.size == 0
    _, codes, meta, _, _ = pack_all([], [], [], 256, 1)
    assert codes.size == meta.shape[0] == 0


def test_the_thread_pool_kernel_beyond_the_serial_size():
    rng = np.random.default_rng(5)
    sizes = [cpu.SERIAL_PACK + 129, 4000, cpu.SERIAL_UNPACK + 3]
    widths, zeros = [2, 4, 1], [True, False, False]
    assert_each_alone(_parts(rng, sizes, zeros), widths, zeros, group_size=64)


def test_round_to_nearest_and_the_segment_offsets():
    rng = np.random.default_rng(9)
    assert_each_alone(_parts(rng, [100, 1000], [False, False]), [2, 4], [False, False],
                      stochastic=False)
    # where each segment's elements (its random stream's base), groups and bytes begin
    start, group, codes_at = cpu_segments.segment_table([5, 0, 300], [2, 8, 4], [0] * 3, 128)[:3]
    assert start.tolist() == [0, 5, 5, 305]
    assert group.tolist() == [0, 1, 1, 4]
    assert codes_at.tolist() == [0, 32, 32, 224]


def test_mismatched_segment_arrays_are_refused():
    table = cpu_segments.segment_table([4, 4], [2, 2], [False, False], 8)
    with pytest.raises(ValueError, match="one entry more"):
        cpu_segments.pack_segments(np.zeros(8, np.float32), np.zeros(4, np.uint8),
                                   np.zeros((2, 2), np.uint16), table[:4], 8, 1)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.integers(0, 600), st.sampled_from(layout.SUPPORTED_BITS),
                          st.booleans()), min_size=1, max_size=6),
       st.sampled_from([8, 64, 256]), st.integers(0, 2**40))
def test_any_segments_match_the_reference(specs, group_size, seed):
    rng = np.random.default_rng(len(specs))
    zeros = [z and b >= 2 for _, b, z in specs]
    widths = [b for _, b, _ in specs]
    assert_each_alone(_parts(rng, [n for n, _, _ in specs], zeros), widths, zeros,
                      group_size=group_size, seed=seed)
