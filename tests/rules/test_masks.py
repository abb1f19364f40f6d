"""Mask rules: ReLU, ReLU6, hardtanh, leaky ReLU and clamp give PyTorch's gradients exactly
at every width; their saved state is a mask or a zero-exact packed output."""

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

import actune
from tests.rules.helpers import DTYPES, check_rule

OPS = {
    "relu": lambda t: F.relu(t * 1.0),
    "relu_inplace": lambda t: torch.relu_(t * 1.0),
    "relu6": lambda t: F.relu6(t * 3.0),
    "hardtanh": lambda t: F.hardtanh(t * 1.0, -0.5, 0.7),
    "leaky_relu": lambda t: F.leaky_relu(t * 1.0, 0.2),
    "clamp": lambda t: (t * 1.0).clamp(min=-0.3),
    "clip": lambda t: torch.clip(t * 1.0, -0.3, 0.4),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", list(OPS))
def test_mask_rule(op, dtype):
    check_rule(OPS[op], lambda t: t, dtype, exact_only=True)


def test_dropout_mask_is_exact_and_one_bit():
    import actune

    x = torch.randn(64, 64, requires_grad=True)
    torch.manual_seed(3)
    st = []
    with actune.compressed("L3", stats=st.append):
        y = F.dropout(x * 1.0, 0.3)
    (g,) = torch.autograd.grad(y.sum(), x)
    keep = y != 0
    assert torch.equal(g, keep.float() / 0.7)
    assert st[0].by_kind.get("mask", 0) <= 64 * 64 / 8 + 64


def _conv_relu_conv(inplace: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(inplace),
                               torch.nn.Conv2d(8, 8, 3, padding=1))


def _grad_fns(y: torch.Tensor) -> set[str]:
    seen, todo = set(), [y.grad_fn]
    while todo:
        node = todo.pop()
        if node is not None and type(node).__name__ not in seen:
            seen.add(type(node).__name__)
            todo.extend(n for n, _ in node.next_functions)
    return seen


@pytest.mark.parametrize("inplace", [False, True])
def test_a_small_relu_is_pytorchs_own_with_its_output_packed_once_with_exact_zeros(inplace):
    import actune

    model, x = _conv_relu_conv(inplace), torch.randn(2, 3, 16, 16)  # 4,096-element ReLU
    st = []
    with actune.compressed("u2", stats=st.append):
        y = model(x)
    names = _grad_fns(y)
    assert "PackedReLUBackward" not in names and any(n.startswith("Relu") for n in names)
    # the ReLU's output is packed once (2 bits, code 0 for its zeros) and shared with the
    # second convolution, whose input it is; the first convolution's input is the other one
    assert st[0].packed == 2 and st[0].by_kind["relu"] == 4096 // 256 * (256 * 2 // 8 + 4)
    y.square().sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]

    # the mask is exact: the gradient reaching the first convolution's output passes only the
    # second's weight and the ReLU's mask, so that convolution's bias gradient is PyTorch's;
    # the second's weight gradient reads the rounded output
    model.zero_grad()
    model(x).square().sum().backward()
    exact = [p.grad for p in model.parameters()]
    torch.testing.assert_close(grads[1], exact[1], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(grads[2], exact[2], rtol=1e-3, atol=1e-3)


def test_a_large_relu_and_one_under_an_allocator_run_packed_relu(monkeypatch):
    import actune
    from actune import tunables

    model, x = _conv_relu_conv(False), torch.randn(2, 3, 16, 16)
    monkeypatch.setattr(tunables, "LEAN_NUMEL", 4096)  # the ReLU is large now
    with actune.compressed("u2"):
        y = model(x)
    assert "PackedReLUBackward" in _grad_fns(y)
    monkeypatch.setattr(tunables, "LEAN_NUMEL", 1 << 20)
    ap = actune.AutoPrecision(2.0)
    with actune.compressed("L3", autoprec=ap):
        y = model(x)
    assert "PackedReLUBackward" in _grad_fns(y)


PIECEWISE = {
    "hardsigmoid": lambda t: F.hardsigmoid(t * 3.0),
    "hardsigmoid_inplace": lambda t: F.hardsigmoid(t * 3.0, inplace=True),
    "hardshrink": lambda t: F.hardshrink(t, 0.4),
    "hardshrink_method": lambda t: t.hardshrink(0.4),
    "softshrink": lambda t: F.softshrink(t, 0.4),
    "threshold": lambda t: F.threshold(t, 0.1, -2.0),
    "threshold_inplace": lambda t: F.threshold(t * 1.0, 0.1, -2.0, True),
    "clamp_min": lambda t: torch.clamp_min(t, 0.2),
    "clamp_max": lambda t: t.clamp_max(-0.2),
    "rrelu_eval": lambda t: F.rrelu(t, 0.1, 0.3),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", list(PIECEWISE))
def test_piecewise_linear_activation_keeps_a_mask(op, dtype):
    check_rule(PIECEWISE[op], lambda t: t, dtype, exact_only=True, kind="mask")


@pytest.mark.parametrize("channels", [1, 8])
def test_prelu_keeps_a_mask_and_its_negative_inputs_rounded(channels):
    from tests.rules.helpers import exact_grads, input_grads, kept_kinds, level, relative_error

    x = torch.randn(4, 8, 6, 6, generator=torch.Generator().manual_seed(1), requires_grad=True)
    w = torch.full((channels,), 0.25).add_(torch.arange(channels) * 0.05).requires_grad_()
    kinds = kept_kinds(F.prelu, (x, w), level(2))
    assert kinds.get("mask", 0) > 0 and kinds.get("other", 0) > 0
    gx, gw = exact_grads(F.prelu, (x, w))
    x8, w8 = input_grads(F.prelu, (x, w), level(8), 1)
    assert torch.equal(x8[0], gx[0])  # the input's gradient reads only the mask and weight
    assert relative_error(w8[0], gw[0]) < 0.01
    _, w2 = input_grads(F.prelu, (x, w), level(2), 256)
    assert not torch.equal(w2[0], gw[0])  # rounded
    # unbiased: the mean of 256 draws within 5 standard errors of the exact gradient
    z = (w2.mean(0) - gw[0]).abs() / (w2.std(0) / 16)
    assert z.max().item() < 5, z


def _with_ties_and_nans(shape, seed):
    t = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).mul(2).round()
    t[0, :3] = float("nan")  # (PyTorch passes a NaN's gradient through)
    return t.requires_grad_()


TWO = {
    "maximum": lambda a, b: torch.maximum(a, b),
    "minimum, method": lambda a, b: a.minimum(b),
    "max of two": lambda a, b: torch.max(a, b),
    "min of two, broadcast": lambda a, b: torch.min(a, b[:1]),
}


@pytest.mark.parametrize("name", list(TWO))
def test_the_maximum_of_two_tensors_keeps_three_bit_masks_and_pytorchs_gradient(name):
    """Ties (integers) split the gradient, NaNs pass it to both, a broadcast operand sums it:
    PyTorch's gradient exactly, from three 1-bit masks in place of both operands."""
    fn = TWO[name]
    a, b = _with_ties_and_nans((64, 100), 0), _with_ties_and_nans((64, 100), 1)
    g = torch.randn(64, 100, generator=torch.Generator().manual_seed(2))
    exact = torch.autograd.grad(fn(a * 1.0, b * 1.0), (a, b), g)
    stats = []
    with actune.compressed("L3", stats=stats.append):
        out = fn(a * 1.0, b * 1.0)
    found = torch.autograd.grad(out, (a, b), g)
    for e, f in zip(exact, found, strict=True):
        assert torch.equal(e, f)
    assert stats[0].exact == {} and set(stats[0].by_kind) == {"mask"}, stats[0]
    assert stats[0].kept_bytes == 3 * 64 * 100 // 8


EXTREMA = {
    "amax, keepdim": lambda t: torch.amax(t, -1, keepdim=True),
    "amax of all": lambda t: t.amax((0, 1)),
    "amin along a dim": lambda t: t.amin(dim=0),
    "max of all": lambda t: torch.max(t),
    "min of all, method": lambda t: t.min(),
}


@pytest.mark.parametrize("name", list(EXTREMA))
@pytest.mark.parametrize("nan", [False, True])
def test_a_maximum_over_dimensions_keeps_a_mask_of_where_it_is_reached(name, nan):
    fn = EXTREMA[name]
    x = torch.randn(64, 100, generator=torch.Generator().manual_seed(0)).mul(2).round()
    if nan:  # (max(x) of a NaN: PyTorch's backward reads the NaNs as its ties)
        x[5, 7] = x[9, 9] = float("nan")
    x.requires_grad_()
    expected = fn(x * 1.0)
    stats = []
    with actune.compressed("L3", stats=stats.append):
        got = fn(x * 1.0)
    assert torch.equal(got, expected) or (nan and torch.allclose(got, expected, equal_nan=True))
    assert stats[0].exact == {} and set(stats[0].by_kind) == {"mask"}, stats[0]
    g = torch.randn(expected.shape, generator=torch.Generator().manual_seed(1))
    (exact,) = torch.autograd.grad(expected, x, g)
    (found,) = torch.autograd.grad(got, x, g)
    assert torch.allclose(found, exact, rtol=0, atol=0, equal_nan=True)
