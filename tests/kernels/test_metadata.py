"""The 16-bit metadata: covers every group, never overflows, picks a grid that fits."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from actune_kernels import layout
from actune_kernels import reference as ref

from .test_cpu_matches_reference import assert_same


def groups_of(x, group_size):
    g = layout.num_groups(x.size, group_size)
    padded = np.full(g * group_size, np.nan)
    padded[: x.size] = x
    return padded.reshape(g, group_size)


@given(
    x=hnp.arrays(
        np.float32, st.integers(1, 600),
        elements=st.floats(-(2.0**127), 2.0**127, allow_infinity=False, allow_nan=False, width=32)
        | st.floats(-(2.0**-100), 2.0**-100, width=32),
    ),
    bits=st.sampled_from(layout.SUPPORTED_BITS),
)
def test_lo_and_scale_cover_the_group(x, bits):
    _, meta = ref.pack(x, bits, 64, 0)
    lo, scale = ref.meta_values(meta)
    grid = groups_of(x.astype(np.float64), 64)
    mn, mx = np.nanmin(grid, axis=1), np.nanmax(grid, axis=1)
    ok = np.maximum(np.abs(mn), np.abs(mx)) <= 2.0**126
    assert np.all(np.isfinite(lo[ok])) and np.all(np.isfinite(scale[ok]))
    assert np.all(lo[ok] <= mn[ok])
    assert np.all(lo[ok] + ((1 << bits) - 1) * scale[ok] >= mx[ok])
    assert np.all(np.isnan(lo[~ok]))  # beyond +-2**126: invalid, dequantizes to NaN


def test_float16_grid_for_ordinary_values():
    x = np.linspace(-3, 5, 256, dtype=np.float32)
    _, meta = ref.pack(x, 2, 256, 0)
    assert meta[0, 1] & layout.BF16_FLAG == 0
    lo, scale = ref.meta_values(meta)
    assert lo[0] == -3.0
    assert 8 / 3 <= scale[0] < 8 / 3 * (1 + 2**-10)


@pytest.mark.parametrize("magnitude", [1e6, 3e30, 1e-9, 1e-30, 1e-37])
def test_beyond_float16_range_or_precision_uses_bfloat16_never_inf(magnitude):
    x = (np.random.default_rng(0).standard_normal(512) * magnitude).astype(np.float32)
    _, meta, y = assert_same(x, 2)
    assert np.all(meta[:, 1] & layout.BF16_FLAG)
    assert np.all(np.isfinite(y))
    # within one step: a third of a ~8-sigma range, or the smallest step (2**-100)
    assert np.max(np.abs(y - x)) <= max(4 * magnitude, 2.0**-100)


def test_float64_input_far_beyond_float32_range_is_invalid_nan():
    x = np.array([1e300, 2.0, 3.0])
    _, _, y = assert_same(x, 8)
    assert np.all(np.isnan(y))


@pytest.mark.parametrize("value", [0.0, 1.0, -2.5, 1024.0, 3.0517578125e-05])
@pytest.mark.parametrize("bits", layout.SUPPORTED_BITS)
def test_constant_groups_round_trip_exactly(value, bits):
    x = np.full(300, value, np.float32)
    _, meta, y = assert_same(x, bits)
    _, scale = ref.meta_values(meta)
    assert np.all(scale == 0)  # no division by zero: the step is 0, every code 0
    np.testing.assert_array_equal(y, x)


def test_constant_group_of_unrepresentable_value_is_within_one_step():
    x = np.full(256, 0.1, np.float32)  # not a float16: lo rounds down, a tiny step covers it
    _, meta, y = assert_same(x, 2)
    lo, scale = ref.meta_values(meta)
    assert lo[0] <= 0.1 <= lo[0] + 3 * scale[0]
    assert np.max(np.abs(y - x)) <= 3 * scale[0] < 1e-3


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_values_propagate_as_nan_in_their_group_only(bad):
    x = np.random.default_rng(0).standard_normal(512).astype(np.float32)
    x[300] = bad
    _, meta, y = assert_same(x, 2)
    assert meta[1, 0] == layout.NAN16
    assert np.all(np.isnan(y[256:]))
    assert np.all(np.isfinite(y[:256]))
