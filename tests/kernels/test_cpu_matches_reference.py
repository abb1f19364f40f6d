"""The Numba CPU kernels produce the reference's bytes, exactly."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from actune_kernels import cpu, layout
from actune_kernels import reference as ref


def pack_cpu(x, bits, group_size, seed, stochastic=True, base=0, zero_code=False):
    g = layout.num_groups(x.size, group_size)
    codes = np.full(layout.codes_nbytes(x.size, bits, group_size), 0xAA, np.uint8)
    meta = np.full((g, 2), 0xAAAA, np.uint16)
    cpu.pack(x, codes, meta, bits, group_size, seed, base, stochastic, zero_code)
    return codes, meta


def assert_same(x, bits, group_size=256, seed=7, stochastic=True, base=0, zero_code=False):
    c_ref, m_ref = ref.pack(x, bits, group_size, seed, stochastic, base, zero_code)
    c, m = pack_cpu(x, bits, group_size, seed, stochastic, base, zero_code)
    np.testing.assert_array_equal(m, m_ref)
    np.testing.assert_array_equal(c, c_ref)
    y_ref = ref.unpack(c_ref, m_ref, bits, x.size, group_size, x.dtype, zero_code)
    y = np.full(x.size, 99, x.dtype)
    cpu.unpack(c, m, bits, group_size, y, zero_code)
    np.testing.assert_array_equal(y.view(np.uint8), y_ref.view(np.uint8))
    return c, m, y


@pytest.mark.parametrize("bits", layout.SUPPORTED_BITS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", [1, 5, 255, 256, 257, 4096 + 77])
@pytest.mark.parametrize("stochastic", [True, False])
def test_bytes_match(bits, dtype, n, stochastic):
    rng = np.random.default_rng(n * 10 + bits)
    x = (rng.standard_normal(n) * 2.5 + 0.3).astype(dtype)
    assert_same(x, bits, stochastic=stochastic)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("stochastic", [True, False])
def test_zero_code_bytes_match_and_zeros_stay_exact(bits, dtype, stochastic):
    rng = np.random.default_rng(bits)
    x = np.maximum(rng.standard_normal(3000), 0).astype(dtype)
    x[256:512] = 0  # an all-zero group
    x[600:700] *= 1e-20  # tiny positives beside large ones
    x[800] = 1e-40 if dtype == np.float64 else 1e-44  # below every grid: still positive
    _, _, y = assert_same(x, bits, stochastic=stochastic, zero_code=True)
    np.testing.assert_array_equal(y > 0, x > 0)


@pytest.mark.parametrize("group_size", [8, 64, 1024])
def test_other_group_sizes(group_size):
    x = np.random.default_rng(1).standard_normal(3000).astype(np.float32)
    assert_same(x, 4, group_size=group_size)


@pytest.mark.parametrize("base", [2**31 - 300, 2**32 - 300, 2**33 + 5, 2**40 - 1000])
def test_stream_indices_beyond_32_bits(base):
    """Tensors over 2**31 elements: the stream index of an element is 64-bit. Packing a slice
    with ``base`` = its offset exercises that arithmetic without allocating 2**31 elements,
    including groups whose indices cross a 2**32 boundary."""
    x = np.random.default_rng(2).standard_normal(2000).astype(np.float32)
    c, _, _ = assert_same(x, 2, base=base)
    c0, _ = pack_cpu(x, 2, 256, 7, base=0)
    assert not np.array_equal(c, c0)  # the high bits of the index do change the stream


def test_64_bit_index_keys_differ_per_block():
    idx = np.array([5, 5 + 2**32, 5 + 2**33], dtype=np.uint64)
    r = ref.random24(3, idx)
    assert len(set(r.tolist())) == 3


@given(
    x=hnp.arrays(
        dtype=st.sampled_from([np.float32, np.float64]),
        shape=st.integers(1, 700),
        elements=st.floats(-1e4, 1e4, allow_nan=False, width=32),
    ),
    bits=st.sampled_from(layout.SUPPORTED_BITS),
    seed=st.integers(0, 2**31 - 1),
    stochastic=st.booleans(),
    zero_code=st.booleans(),
)
def test_property_bytes_match(x, bits, seed, stochastic, zero_code):
    zero_code = zero_code and bits > 1
    if zero_code:
        x = np.maximum(x, 0)
    assert_same(x, bits, group_size=64, seed=seed, stochastic=stochastic, zero_code=zero_code)


@pytest.mark.parametrize("n", [cpu.SERIAL_PACK - 1, cpu.SERIAL_PACK, cpu.SERIAL_UNPACK + 300])
def test_one_thread_and_the_pool_give_the_same_bytes_around_the_size_switch(n):
    """Small tensors run on the calling thread, large ones on the pool: both the reference's
    bytes (sizes on either side of where :func:`cpu.pack` / :func:`cpu.unpack` switch)."""
    rng = np.random.default_rng(n)
    x = (rng.standard_normal(n) * 3).astype(np.float32)
    assert_same(x, 2, base=2**32 - 1000)  # a group crossing a 2**32 stream boundary too
    c, m = pack_cpu(x, 4, 256, 3)
    args = (x.ctypes.data, n, np.float32(0), np.int32(0x7FFFFFFF), np.int32(0x7F800000))
    for kernel in (cpu._pack, cpu._pack_serial):
        c2, m2 = np.zeros_like(c), np.zeros_like(m)
        kernel(*args, c2.ctypes.data, m2.ctypes.data, 4, 256, 3, 0, True, False)
        np.testing.assert_array_equal(c2, c)
        np.testing.assert_array_equal(m2, m)
    outs = [np.empty(n, np.float32) for _ in range(2)]
    for kernel, out in zip((cpu._unpack, cpu._unpack_serial), outs, strict=True):
        kernel(c.ctypes.data, m.ctypes.data, 4, 256, False, out.ctypes.data, n, np.float32(0))
    np.testing.assert_array_equal(outs[0].view(np.uint8), outs[1].view(np.uint8))
