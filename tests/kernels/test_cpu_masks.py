"""Dropout keep masks from the counter-based stream: the CPU kernel against the reference."""

import numpy as np
import pytest

from actune_kernels import cpu_masks, reference


@pytest.mark.parametrize("n", [1, 7, cpu_masks.SERIAL_MASK - 1, 3 * (1 << 16) + 5])
def test_cpu_mask_matches_the_reference(n):
    out = np.empty(n, np.uint8)
    cpu_masks.keep_mask(out, 12345, 0.9)
    assert np.array_equal(out.astype(bool), reference.keep_mask(n, 12345, 0.9))


def test_probability_and_seeds():
    n = 1 << 18
    a, b = np.empty(n, np.bool_), np.empty(n, np.bool_)
    cpu_masks.keep_mask(a, 1, 0.3)
    cpu_masks.keep_mask(b, 2, 0.3)
    assert abs(a.mean() - 0.3) < 0.005  # 262,144 draws: sd 0.0009
    assert 0.08 < (a & b).mean() < 0.1  # independent streams: 0.09
    for keep, value in ((0.0, False), (1.0, True)):
        cpu_masks.keep_mask(a, 3, keep)
        assert (a == value).all()


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="keep probability"):
        cpu_masks.keep_mask(np.empty(4, np.uint8), 0, 1.5)
    with pytest.raises(ValueError, match="one-byte items"):
        cpu_masks.keep_mask(np.empty(4, np.float32), 0, 0.5)
