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
