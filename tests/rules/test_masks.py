"""Mask rules: ReLU, ReLU6, hardtanh, leaky ReLU and clamp give PyTorch's gradients exactly
at every width; their saved state is a mask or a zero-exact packed output."""

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

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
