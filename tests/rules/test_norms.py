"""Norm rules: the input rounded, the statistics exact; gradients close at 8 bits and
unbiased at 2 bits (reductions of 64 and more elements), in float32 and bfloat16."""

import pytest
import torch.nn.functional as F  # noqa: N812

from tests.rules.helpers import DTYPES, check_rule

OPS = {
    "layer_norm": lambda t: F.layer_norm(t * 1.0, (64,)).square(),
    "rms_norm": lambda t: F.rms_norm(t * 1.0, (64,)).square(),
    "group_norm": lambda t: F.group_norm(t.view(64, 8, 8) * 1.0, 2).square(),
    "batch_norm": lambda t: F.batch_norm(t.view(16, 4, 8, 8) * 1.0, None, None,
                                         training=True).square(),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", list(OPS))
def test_norm_rule(op, dtype):
    check_rule(OPS[op], lambda t: t, dtype, shape=(64, 64))
