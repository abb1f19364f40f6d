"""Codebooks of a derivative (Few-Bit Backward): the fitted levels, the packed codes, and GELU's
rule keeping its derivative's codes at a level with ``derivative_codes``."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from hypothesis import given
from hypothesis import strategies as st

import actune
from actune.packing import codebooks
from actune.packing.codebooks import gelu_codebook
from actune.packing.codes import dequantize_codes, pack_codes, unpack_codes
from tests.rules.helpers import exact_grads, input_grads, level, relative_error


@given(bits=st.sampled_from((1, 2, 4, 8)), n=st.integers(1, 300), seed=st.integers(0, 2**16))
def test_codes_round_trip_exactly(bits, n, seed):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (n,), generator=gen, dtype=torch.uint8)
    packed = pack_codes(codes.view(n, 1), bits)
    assert packed.nbytes == math.ceil(n * bits / 8)
    assert torch.equal(unpack_codes(packed), codes.view(n, 1))
    levels = tuple(float(k * k - 3) for k in range(2**bits))
    values = dequantize_codes(pack_codes(codes.view(n, 1), bits, levels, torch.float64))
    assert torch.equal(values, torch.tensor(levels, dtype=torch.float64)[codes.long()].view(n, 1))


def test_codes_take_whole_bytes_only():
    with pytest.raises(ValueError, match="packed at"):
        pack_codes(torch.zeros(4, dtype=torch.uint8), 3)


def _normal_mse(book: codebooks.Codebook, derivative) -> float:
    x = torch.linspace(-8, 8, 20_001, dtype=torch.float64)
    w = torch.exp(-x * x / 2)
    d = derivative(x)
    err = book.decode(book.encode(d), torch.float64) - d
    return ((w * err * err).sum() / w.sum()).item()


def test_fitted_levels_beat_an_even_grid():
    """Lloyd-Max levels, started from an even grid: each iteration lowers the mean square
    error under the normal, so the fitted levels beat the grid they started from."""
    def derivative(x):
        return torch.ops.aten.gelu_backward(torch.ones_like(x), x)

    for bits in (1, 2, 4):
        book = codebooks.fit(derivative, bits)
        assert len(book.levels) == 2**bits
        assert list(book.levels) == sorted(book.levels)
        d = derivative(torch.linspace(-8, 8, 1001, dtype=torch.float64))
        even = codebooks.Codebook(tuple(torch.linspace(d.min(), d.max(), 2**bits).tolist()),
                                  bits)
        assert _normal_mse(book, derivative) < 0.9 * _normal_mse(even, derivative)
    # halving the error's rms per added bit, as a scalar quantizer of a smooth density does
    two, four = (_normal_mse(codebooks.fit(derivative, b), derivative) for b in (2, 4))
    assert four < two / 10


def test_encode_picks_the_nearest_level():
    book = codebooks.Codebook((-1.0, 0.0, 0.5, 2.0), 2)
    values = torch.tensor([-3.0, -0.6, -0.4, 0.2, 0.3, 1.2, 1.3, 9.0])
    assert book.encode(values).tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert book.decode(book.encode(values), torch.float32).tolist() == [
        -1.0, -1.0, 0.0, 0.0, 0.5, 0.5, 2.0, 2.0]


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("bits", [2, 4])
def test_gelu_keeps_codes_of_its_derivative(approximate, bits):
    """At a level with derivative_codes, GELU keeps ``bits`` per element, the forward is exact,
    and the gradient is ``grad`` times the code's level: the same in every draw
    (deterministic), off by the codebook's error alone."""
    x = torch.randn(32, 256, generator=torch.Generator().manual_seed(0)).requires_grad_()
    fn = lambda t: F.gelu(t, approximate=approximate)  # noqa: E731
    lv = level(2, derivative_codes=bits)
    stats = []
    with actune.compressed(lv, stats=stats.append):
        y = fn(x)
    assert torch.equal(y, fn(x.detach()))
    assert stats[0].by_kind == {"derivative": x.numel() * bits // 8}
    (exact,) = exact_grads(fn, (x,))
    (draws,) = input_grads(fn, (x,), lv, 3)
    assert torch.equal(draws[0], draws[1]) and torch.equal(draws[1], draws[2])
    book = gelu_codebook(approximate, bits)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(5))
    d = torch.ops.aten.gelu_backward(torch.ones_like(x), x.detach(), approximate=approximate)
    torch.testing.assert_close(draws[0], g * book.decode(book.encode(d), torch.float32))
    assert relative_error(draws[0], exact[0]) < (0.2 if bits == 2 else 0.05)


def test_derivative_codes_are_checked():
    with pytest.raises(ValueError, match="derivative_codes"):
        level(2, derivative_codes=3)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_traced_gelu_keeps_the_same_codes(approximate):
    """The traced rule (what runs in a compiled graph, here run eagerly) keeps the same codes
    as the eager one: the same gradient, to rounding of the float32 derivative."""
    from actune.traced import TracedMode

    x = torch.randn(16, 128, generator=torch.Generator().manual_seed(1)).requires_grad_()
    g = torch.randn(16, 128, generator=torch.Generator().manual_seed(5))
    fn = lambda t: F.gelu(t, approximate=approximate)  # noqa: E731
    lv = level(2, derivative_codes=2)
    with TracedMode(lv):
        y = fn(x * 1)
    (traced,) = torch.autograd.grad(y, x, g)
    (eager,) = input_grads(fn, (x,), lv, 1)
    assert torch.equal(y, fn(x.detach()))
    mismatched = (~torch.isclose(traced, eager[0], rtol=1e-5, atol=1e-6)).float().mean().item()
    assert mismatched < 1e-3  # (a derivative on a midpoint may round to either neighbour)
    torch.testing.assert_close(traced, eager[0], atol=0.4 * g.abs().max().item(), rtol=0)


def test_an_estimate_on_fake_tensors_leaves_the_codebook_real():
    """Fake tensors (the tuner's estimates) run the same rule; the codebook's cached tensors
    stay real ones, so the next real step runs."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    lv = level(2, derivative_codes=2)
    with FakeTensorMode():
        x = torch.randn(8, 512, requires_grad=True)
        with actune.compressed(lv):
            y = F.gelu(x)
        y.sum().backward()
    x = torch.randn(8, 512, requires_grad=True)
    with actune.compressed(lv):
        y = F.gelu(x)
    y.sum().backward()
    assert type(x.grad) is torch.Tensor and x.grad.abs().sum() > 0
