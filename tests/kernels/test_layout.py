import pytest

from actune_kernels import layout


def test_metadata_overhead_at_2_bits_group_256_is_an_eighth_of_a_bit():
    n = 256 * 1000
    extra = layout.packed_nbytes(n, 2, 256) * 8 / n - 2
    assert extra == pytest.approx(0.125)


def test_padding_is_per_tensor_not_per_row():
    # ActNN pads each row of a [4096, 64] tensor to 256 elements (4x the data); we pad once.
    n = 4096 * 64
    assert layout.codes_nbytes(n, 2, 256) == n * 2 // 8
    assert layout.codes_nbytes(n + 1, 2, 256) == (n + 256) * 2 // 8


@pytest.mark.parametrize("bits", [0, 3, 16, -1])
def test_unsupported_bits_are_rejected(bits):
    with pytest.raises(ValueError, match="bits must be one of"):
        layout.check_bits(bits)


@pytest.mark.parametrize("group_size", [0, 7, 12, 1 << 17, 256.0])
def test_bad_group_sizes_are_rejected(group_size):
    with pytest.raises(ValueError, match="group_size"):
        layout.check_group_size(group_size)


def test_sizes_of_empty_and_single_element():
    assert layout.packed_nbytes(0, 2, 256) == 0
    assert layout.packed_nbytes(1, 2, 256) == 64 + 4
