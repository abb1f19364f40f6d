"""Stochastic rounding is unbiased and has the variance the formula predicts, per bit width.

Fixed seeds and sizes: the outcome is deterministic. Tolerances are stated per test.
"""

import numpy as np
import pytest

from actune_kernels import cpu, layout
from actune_kernels import reference as ref

SAMPLES = 3000
N = 512


def draws(x, bits, zero_code=False):
    g = layout.num_groups(x.size, 256)
    codes = np.empty(layout.codes_nbytes(x.size, bits, 256), np.uint8)
    meta = np.empty((g, 2), np.uint16)
    out = np.empty((SAMPLES, x.size), np.float64)
    y = np.empty(x.size, x.dtype)
    for s in range(SAMPLES):
        cpu.pack(x, codes, meta, bits, 256, seed=1000 + s, zero_code=zero_code)
        cpu.unpack(codes, meta, bits, 256, y, zero_code)
        out[s] = y
    lo, scale = ref.meta_values(meta)  # the same for every seed
    return out, np.repeat(lo, 256)[: x.size], np.repeat(scale, 256)[: x.size]


@pytest.fixture(scope="module", params=[(b, False) for b in layout.SUPPORTED_BITS]
                + [(2, True), (4, True)], ids=lambda p: f"{p[0]}bit{'-zero_code' * p[1]}")
def sampled(request):
    bits, zero_code = request.param
    x = np.random.default_rng(bits).standard_normal(N).astype(np.float64)
    if zero_code:  # ReLU outputs: zeros must stay exact, positives unbiased
        x = np.maximum(x, 0)
    out, lo, step = draws(x, bits, zero_code)
    frac = (x - lo) / step - np.floor((x - lo) / step)
    var = np.where(x > 0, frac * (1 - frac) * step**2, 0.0) if zero_code else (
        frac * (1 - frac) * step**2)
    if zero_code:
        assert np.all(out[:, x == 0] == 0) and np.all(out[:, x > 0] > 0)
    return x, out, step, var


def test_unbiased_within_4_standard_errors(sampled):
    x, out, _, var = sampled
    se = np.sqrt(var / SAMPLES)
    z = (out.mean(axis=0) - x)[var > 0] / se[var > 0]
    assert np.max(np.abs(z)) < 4.5  # 512 elements: P(any |z| > 4.5) ~ 4e-3 for a fair coin
    assert abs(np.mean(z**2) - 1) < 0.15  # the errors are noise of the predicted size


def test_variance_matches_formula_within_10_percent(sampled):
    _, out, step, var = sampled
    measured = out.var(axis=0)
    assert np.all(measured <= step**2 / 4 * 1.25)  # bound step**2/4, plus sampling noise
    assert np.sum(measured) / np.sum(var) == pytest.approx(1.0, abs=0.10)
