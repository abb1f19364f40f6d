"""The kernels taken by address (:func:`cpu.pack_at`, :func:`cpu.unpack_at`, what
:mod:`actune.packing.tensors` calls with tensors' addresses) and the array entry points around
them."""

import numpy as np
import pytest

from actune_kernels import cpu, layout
from actune_kernels import reference as ref


@pytest.mark.parametrize("offset", [1, 5])
@pytest.mark.parametrize("n", [1, 300, cpu.SERIAL_PACK + 300])
def test_an_address_inside_a_buffer_packs_the_values_from_there(n, offset):
    """A view's address (not its buffer's start) packs and unpacks that view's values alone:
    the reference's bytes, and nothing written before or after the given lengths."""
    whole = np.random.default_rng(n).standard_normal(n + offset).astype(np.float32)
    view = whole[offset:]
    nbytes = layout.codes_nbytes(n, 2, 256)
    groups = layout.num_groups(n, 256)
    codes = np.full(nbytes + 8, 0xAA, np.uint8)  # guard bytes past the end
    meta = np.full((groups + 1, 2), 0xAAAA, np.uint16)
    cpu.pack_at(view.ctypes.data, n, view.dtype, codes.ctypes.data, meta.ctypes.data, 2, 256, 11)
    c_ref, m_ref = ref.pack(np.ascontiguousarray(view), 2, 256, 11)
    np.testing.assert_array_equal(codes[:nbytes], c_ref)
    np.testing.assert_array_equal(meta[:groups], m_ref)
    assert (codes[nbytes:] == 0xAA).all() and (meta[groups:] == 0xAAAA).all()
    out = np.full(n + 2, 99, np.float32)
    cpu.unpack_at(codes.ctypes.data, meta.ctypes.data, 2, 256, out[1:].ctypes.data, n,
                  out.dtype)
    y_ref = ref.unpack(c_ref, m_ref, 2, n, 256, np.float32)
    np.testing.assert_array_equal(out[1:-1], y_ref)
    assert out[0] == 99 and out[-1] == 99


def test_zero_elements_touch_nothing():
    cpu.pack_at(0, 0, np.dtype(np.float32), 0, 0, 2, 256, 1)  # null addresses: never read
    cpu.unpack_at(0, 0, 2, 256, 0, 0, np.dtype(np.float64))
    codes, meta = np.full(64, 0xAA, np.uint8), np.full((1, 2), 0xAAAA, np.uint16)
    out = np.full(4, 99.0)
    cpu.pack_at(out.ctypes.data, 0, out.dtype, codes.ctypes.data, meta.ctypes.data, 2, 256, 1)
    cpu.unpack_at(codes.ctypes.data, meta.ctypes.data, 2, 256, out.ctypes.data, 0, out.dtype)
    assert (codes == 0xAA).all() and (meta == 0xAAAA).all() and (out == 99.0).all()


def test_a_strided_input_array_is_packed_as_its_values():
    x = np.random.default_rng(0).standard_normal(1000).astype(np.float64)[::2]
    codes = np.empty(layout.codes_nbytes(x.size, 4, 256), np.uint8)
    meta = np.empty((layout.num_groups(x.size, 256), 2), np.uint16)
    cpu.pack(x, codes, meta, 4, 256, 9)
    c_ref, m_ref = ref.pack(np.ascontiguousarray(x), 4, 256, 9)
    np.testing.assert_array_equal(codes, c_ref)
    np.testing.assert_array_equal(meta, m_ref)


@pytest.mark.parametrize("make", [
    lambda n, g: (np.empty(n, np.uint8)[::2], np.empty((g, 2), np.uint16)),
    lambda n, g: (np.empty(n // 4, np.uint32), np.empty((g, 2), np.uint16)),
    lambda n, g: (np.empty(n, np.uint8), np.empty((2, g), np.uint16).T),
])
def test_output_arrays_that_are_not_contiguous_bytes_say_so(make):
    x = np.zeros(512, np.float32)
    codes, meta = make(2 * 512 // 8 * 2, 2)
    with pytest.raises(ValueError, match="C-contiguous array"):
        cpu.pack(x, codes, meta, 2, 256, 1)
