"""Activation rules: derivatives (GELU, SiLU, sigmoid, tanh), softmax's two copies,
log-softmax's probabilities; gradients close at 8 bits, unbiased at 2 bits, in float32 and
bfloat16."""

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

from tests.rules.helpers import DTYPES, check_rule

OPS = {
    "gelu": F.gelu,
    "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
    "silu": F.silu,
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
    "softmax": lambda t: torch.softmax(t, -1),
    "softmax_dtype": lambda t: F.softmax(t, -1, dtype=torch.float32),
    "log_softmax": lambda t: F.log_softmax(t * 1.0, -1),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", list(OPS))
def test_activation_rule(op, dtype):
    # softmax: tiny probabilities, 8-bit steps of their group's range (4% measured)
    check_rule(OPS[op], lambda t: t * 2, dtype, tolerance=0.06 if "softmax" in op else 0.03)


#: the other smooth activations of torch.nn.functional and unary pointwise ops without a rule
#: of their own: each keeps its derivative (forward-mode AD), counted as "derivative"
SMOOTH = {
    "hardswish": F.hardswish,
    "hardswish_inplace": lambda t: F.hardswish(t * 1.0, inplace=True),
    "elu": lambda t: F.elu(t, 0.7),
    "elu_inplace": lambda t: F.elu(t * 1.0, 0.7, True),
    "selu": F.selu,
    "celu": lambda t: F.celu(t, alpha=1.3),
    "mish": F.mish,
    "softplus": lambda t: F.softplus(t, beta=2.0),
    "logsigmoid": F.logsigmoid,
    "softsign": F.softsign,
    "tanhshrink": F.tanhshrink,
    "glu": lambda t: F.glu(t, -1),
    "softmin": lambda t: F.softmin(t, -1),
    "atan": torch.atan,
    "expm1": lambda t: torch.expm1(t * 0.5),
    "lgamma": lambda t: torch.lgamma(t.abs() + 0.5),
    "asinh_method": lambda t: t.asinh(),
}
_KINDS = {"softmin": "softmax"}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", list(SMOOTH))
def test_smooth_activation_keeps_its_derivative(op, dtype):
    check_rule(SMOOTH[op], lambda t: t * 2, dtype, tolerance=0.06 if op == "softmin" else 0.03,
               kind=_KINDS.get(op, "derivative"))


def test_rrelu_in_training_keeps_the_slopes_it_drew():
    from tests.rules.helpers import exact_grads, input_grads, kept_kinds, level

    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(0), requires_grad=True)
    fn = lambda t: F.rrelu(t, training=True)  # noqa: E731
    assert kept_kinds(fn, (x,), level(2)).get("derivative", 0) > 0
    (exact,) = exact_grads(fn, (x,))
    (eight,) = input_grads(fn, (x,), level(8), 1)  # (drawn from the same seed)
    assert ((eight[0] - exact[0]).norm() / exact[0].norm()).item() < 0.01


def test_ops_that_save_nothing_get_no_rule():
    from actune.rules import rule_for

    for func in (torch.neg, torch.Tensor.__neg__, torch.floor, torch.sign, torch.clone,
                 torch.Tensor.add, torch.isnan):
        assert rule_for(func) is None, func
    for func in (torch.atan, torch.Tensor.atan, torch.special.erfcx, torch.lgamma):
        assert rule_for(func) is not None, func


def test_softmax_backward_centres_the_gradient_before_the_rounded_sum():
    """Attention whose values look alike: the gradient reaching the probabilities has a large
    common part per row, which softmax's backward cancels exactly only where the probabilities
    sum to 1. Centred first, the rounded copies' sums leave that part out: the input
    gradient's error at 4 bits, 0.77 of its norm with the plain form, stays under 0.45 (0.28
    measured), and the mean over draws still approaches exact (unbiased)."""
    from tests.rules.helpers import exact_grads, input_grads, level, relative_error

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 16, generator=gen).requires_grad_()
    v = 3 + 0.3 * torch.randn(16, 32, generator=gen)

    def fn(t):
        return torch.softmax(t * 1.0, -1) @ v

    (exact,) = exact_grads(fn, (x,))
    (draws,) = input_grads(fn, (x,), level(4), 64)
    errors = [relative_error(d, exact) for d in draws[:8]]
    assert sum(errors) / len(errors) < 0.45
    assert relative_error(draws.mean(0), exact) < 0.5 * errors[0]


def _gelu_mlp(w1: torch.Tensor, w2: torch.Tensor, approximate: str):
    def fn(x, w1=w1, w2=w2):
        return F.linear(F.gelu(F.linear(x * 1, w1), approximate=approximate), w2)
    return fn


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_keeps_its_input_once_for_its_derivative_and_the_next_layer(approximate):
    """At a level with gelu_input_bits, GELU keeps its input at those bits and nothing else;
    the linear layer reading its output keeps nothing of its own (it rebuilds the output from
    that copy): two saved tensors for one 4-bit copy. Both gradients it serves (GELU's input
    gradient, the layer's weight gradient) are close at 4 bits and unbiased: the mean over
    draws approaches exact as noise does."""
    from tests.rules.helpers import exact_grads, input_grads, kept_kinds, level, relative_error

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(256, 32, generator=gen).requires_grad_()
    w1 = torch.nn.Parameter(torch.randn(128, 32, generator=gen) / 32**0.5)
    w2 = torch.nn.Parameter(torch.randn(32, 128, generator=gen) / 128**0.5)
    lv = level(2, gelu_input_bits=4)
    fn = _gelu_mlp(w1, w2, approximate)
    kinds = kept_kinds(fn, (x, w1, w2), lv)
    hidden = 256 * 128
    assert kinds["activation input"] == pytest.approx(hidden / 2, rel=0.1)  # 4 bits + steps
    assert kinds["matmul"] == pytest.approx(x.numel() / 4, rel=0.1)  # x alone, at 2 bits
    assert "derivative" not in kinds
    exact = exact_grads(fn, (x, w1, w2))
    # (x's own 2-bit rounding reaches w1's gradient alone: x's and w2's read the copy only)
    draws = input_grads(fn, (x, w1, w2), lv, 64)
    for which in (0, 2):  # through GELU's derivative; through the rebuilt output
        single = relative_error(draws[which][0], exact[which][0])
        assert single < 0.2  # (0.13 and 0.17 measured)
        assert relative_error(draws[which].mean(0), exact[which][0]) < 0.35 * single
    # against the same bytes as a 2-bit output and 2-bit codes of the derivative: the layer
    # reading the output gets a third of the error (0.17 against 0.56 measured)
    (coded,) = input_grads(fn, (x, w1, w2), level(2, derivative_codes=2), 1)[2:]
    assert relative_error(draws[2][0], exact[2][0]) < 0.5 * relative_error(coded[0], exact[2][0])


def test_the_rebuilt_gelu_output_and_derivative_are_debiased():
    """GELU of a stochastically rounded input is biased by half the rounding variance times
    the second derivative (the derivative, by the third); the correction takes at least
    four fifths of that bias off, averaged over many draws."""
    from actune.packing.tensors import dequantize, quantize
    from actune.substitutes.functions import _half_rounding_variance, gelu_function

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=gen) * 0.6 - 0.2
    f = gelu_function("none")
    y, d = F.gelu(x), f.derivative(x, None)
    plain_y, plain_d, fixed_y, fixed_d = (torch.zeros_like(x) for _ in range(4))
    draws = 64
    for seed in range(draws):
        packed = quantize(x, 4, seed=seed)
        v, half_var = dequantize(packed), _half_rounding_variance(packed)
        plain_y += F.gelu(v) / draws
        plain_d += f.derivative(v, None) / draws
        fixed_y += f.debiased_value(v, half_var) / draws
        fixed_d += f.debiased_derivative(v, half_var) / draws
    assert (fixed_y - y).mean().abs() < 0.2 * (plain_y - y).mean().abs()
    assert (fixed_d - d).mean().abs() < 0.2 * (plain_d - d).mean().abs()


def test_gelu_input_bits_are_checked_and_set_where_the_width_is_2_bits():
    import actune
    from tests.rules.helpers import level

    with pytest.raises(ValueError, match="gelu_input_bits"):
        level(2, gelu_input_bits=3)
    for name in ("L3", "L4", "L5", "2b", "1.25b"):
        assert actune.get_level(name).gelu_input_bits == 4, name
    for name in ("L2", "u2", "u8", "4b"):  # (at 4 bits a derivative rounded alone does as well)
        assert actune.get_level(name).gelu_input_bits is None, name
