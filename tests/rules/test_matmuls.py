"""Matmul rules: every spelling keeps its activation rounded; gradients close at 8 bits,
unbiased at 2 bits, in float32 and bfloat16."""

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

from tests.rules.helpers import DTYPES, check_rule

_W = torch.randn(64, 48, generator=torch.Generator().manual_seed(7)) / 8
_B = torch.zeros(48)
_C = torch.randn(6, 4, 3, 3, generator=torch.Generator().manual_seed(8)) / 4

OPS = {
    "linear": lambda t: F.linear(t, _W.t().to(t.dtype)).square(),
    "matmul_operator": lambda t: (t @ _W.to(t.dtype)).square(),
    "addmm": lambda t: torch.addmm(_B.to(t.dtype), t * 1.0, _W.to(t.dtype)).square(),
    "baddbmm": lambda t: torch.baddbmm(_B.to(t.dtype), t.view(4, 4, 64) * 1.0,
                                       _W.to(t.dtype).expand(4, 64, 48)).square(),
    "einsum": lambda t: torch.einsum("ij,jk->ik", t * 1.0, _W.to(t.dtype)).square(),
    "self_product": lambda t: (t @ t.transpose(-1, -2)).square(),
    "conv2d": lambda t: F.conv2d(t.view(4, 4, 8, 8) * 1.0, _C.to(t.dtype), padding=1).square(),
    "conv_transpose2d": lambda t: F.conv_transpose2d(
        t.view(4, 4, 8, 8) * 1.0, _C.transpose(0, 1).to(t.dtype)).square(),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", list(OPS))
def test_matmul_rule(op, dtype):
    check_rule(OPS[op], lambda t: t, dtype)
