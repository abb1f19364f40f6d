"""Activation rules: derivatives (GELU, SiLU, sigmoid, tanh), softmax's two copies,
log-softmax's probabilities; gradients close at 8 bits, unbiased at 2 bits, in float32 and
bfloat16."""

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

from tests.rules.helpers import exact_grads, input_grads, level, relative_error, shrinks_like_noise

DTYPES = [torch.float32, torch.bfloat16]


def check(fn, make, dtype, exact_only=False, shape=(16, 64), tolerance=0.03):
    x = make(torch.randn(shape, generator=torch.Generator().manual_seed(0))).to(dtype)
    x.requires_grad_()
    (exact,) = exact_grads(fn, (x,))
    (eight,) = input_grads(fn, (x,), level(8), 1)
    tolerance = tolerance if dtype == torch.float32 else 0.08
    assert relative_error(eight[0].float(), exact[0].float()) < tolerance
    if dtype != torch.float32:
        return
    (two,) = input_grads(fn, (x,), level(2), 256)
    if exact_only:
        assert torch.equal(two[0], exact[0]) and torch.equal(two[-1], exact[0])
        return
    assert relative_error(two[0], exact[0]) > 1e-3  # it was rounded
    assert shrinks_like_noise(two, exact[0], small=8, large=256) < 0.25


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
    check(OPS[op], lambda t: t * 2, dtype, tolerance=0.06 if "softmax" in op else 0.03)
