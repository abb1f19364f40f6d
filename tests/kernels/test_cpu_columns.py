"""The column layout (groups of rows by one feature): the CPU kernels against the reference."""

import numpy as np
import pytest

from actune_kernels import cpu_columns as cc
from actune_kernels import reference as ref

CASES = [  # (rows, features), bits, rows per group, dtype, zero_code, stochastic, base
    ((1024, 256), 2, 256, np.float32, False, True, 0),
    ((1000, 24), 4, 64, np.float32, False, True, 0),
    ((7, 8), 8, 256, np.float64, False, True, 0),
    ((300, 136), 1, 100, np.float32, False, False, 0),
    ((513, 64), 2, 256, np.float32, True, True, 0),
    ((40, 72), 4, 16, np.float64, True, False, 0),
    ((6, 80), 2, 4, np.float32, False, True, 2**32 - 200),  # rows crossing 2**32 in the stream
]


def pack(x, bits, rows, seed, stochastic, zero_code, base):
    total, width = x.shape
    codes = np.empty(cc.column_codes_nbytes(total, width, rows, bits), np.uint8)
    meta = np.empty((cc.column_groups(total, width, rows), 2), np.uint16)
    cc.pack_columns_at(x.ctypes.data, total, width, x.dtype, codes.ctypes.data,
                       meta.ctypes.data, bits, rows, seed, stochastic, zero_code, base)
    return codes, meta


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[1]}b" for c in CASES])
def test_columns_match_the_reference(case):
    shape, bits, rows, dtype, zero_code, stochastic, base = case
    x = np.random.default_rng(0).standard_normal(shape).astype(dtype)
    if zero_code:
        x = np.maximum(x, 0)
    x[3, 5] = np.nan  # its group (one feature of a row block) dequantizes to NaN
    codes, meta = pack(x, bits, rows, 77, stochastic, zero_code, base)
    want_codes, want_meta = ref.pack_columns(x, bits, rows, 77, stochastic, zero_code, base)
    assert np.array_equal(codes, want_codes) and np.array_equal(meta, want_meta)
    y = np.empty(shape, dtype)
    cc.unpack_columns_at(codes.ctypes.data, meta.ctypes.data, bits, rows, y.ctypes.data,
                         *shape, y.dtype, zero_code)
    want = ref.unpack_columns(codes, meta, bits, *shape, rows, dtype, zero_code)
    assert np.array_equal(y, want, equal_nan=True)
    if zero_code:
        return  # (code 0 is an exact zero there, NaN group or not)
    nan_group = np.isnan(y)
    assert nan_group[(3 // rows) * rows:(3 // rows + 1) * rows, 5].all()
    assert nan_group.sum() == min(rows, shape[0] - (3 // rows) * rows)


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[1]}b" for c in CASES])
def test_unpack_folds_a_product_in_exactly(case):
    """``times_at``: the value times another array's, bit for bit what multiplying the
    dequantized values gives, also written over that array (in place)."""
    shape, bits, rows, dtype, zero_code, stochastic, base = case
    rng = np.random.default_rng(2)
    x = rng.standard_normal(shape).astype(dtype)
    if zero_code:
        x = np.maximum(x, 0)
    codes, meta = pack(x, bits, rows, 9, stochastic, zero_code, base)
    other = rng.standard_normal(shape).astype(dtype)
    want = ref.unpack_columns(codes, meta, bits, *shape, rows, dtype, zero_code) * other
    y = np.empty(shape, dtype)
    cc.unpack_columns_at(codes.ctypes.data, meta.ctypes.data, bits, rows, y.ctypes.data,
                         *shape, y.dtype, zero_code, other.ctypes.data)
    assert np.array_equal(y, want)
    cc.unpack_columns_at(codes.ctypes.data, meta.ctypes.data, bits, rows, other.ctypes.data,
                         *shape, y.dtype, zero_code, other.ctypes.data)
    assert np.array_equal(other, want)


def test_each_feature_keeps_its_own_step():
    # a feature 1,000x smaller than its neighbours keeps its own fine step
    x = np.random.default_rng(1).standard_normal((512, 16)).astype(np.float32)
    x[:, 3] *= 1e-3
    codes, meta = pack(x, 4, 256, 5, True, False, 0)
    y = ref.unpack_columns(codes, meta, 4, 512, 16, 256)
    err = np.abs(y - x).max(axis=0)
    assert err[3] < 1e-2 * err[[0, 1, 2, 4]].min()  # (1e-3 of theirs, less than a step)


def test_width_must_be_a_multiple_of_eight():
    with pytest.raises(ValueError, match="multiple of 8 features"):
        cc.pack_columns_at(0, 4, 12, np.dtype(np.float32), 0, 0, 2, 256, 0)


@pytest.mark.parametrize("features", [8, 24, 64, 1024])
def test_any_task_split_writes_the_same_bytes(features):
    """The features a parallel task takes set only which thread writes what."""
    x = np.random.default_rng(3).standard_normal((300, 136)).astype(np.float32)
    want_codes, want_meta = pack(x, 4, 128, 11, True, False, 0)
    codes = np.empty_like(want_codes)
    meta = np.empty_like(want_meta)
    cc.pack_columns_at(x.ctypes.data, 300, 136, x.dtype, codes.ctypes.data, meta.ctypes.data,
                       4, 128, 11, features=features)
    assert np.array_equal(codes, want_codes) and np.array_equal(meta, want_meta)
    want = ref.unpack_columns(codes, meta, 4, 300, 136, 128, np.float32)
    y = np.empty_like(x)
    cc.unpack_columns_at(codes.ctypes.data, meta.ctypes.data, 4, 128, y.ctypes.data, 300, 136,
                         y.dtype, features=features)
    assert np.array_equal(y, want)


@pytest.mark.parametrize(("shape", "threads", "want"), [
    ((1024, 680, 256), 2, 680),    # four row blocks: a whole block each
    ((256, 2048, 256), 2, 512),    # one block: split for two tasks a thread
    ((4096, 2048, 256), 2, 1024),  # at most MAX_TASK_FEATURES
    ((8, 256, 8), 16, 8),          # many threads, one block: runs of 8 features at least
    ((16, 8, 16), 4, 8),
])
def test_task_features(shape, threads, want):
    got = cc.task_features(*shape, threads)
    assert got == want and got % 8 == 0
