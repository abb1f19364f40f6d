"""Norm rules: the input rounded, the statistics exact; gradients close at 8 bits and
unbiased at 2 bits (reductions of 64 and more elements), in float32 and bfloat16."""

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
    "layer_norm": lambda t: F.layer_norm(t * 1.0, (64,)).square(),
    "rms_norm": lambda t: F.rms_norm(t * 1.0, (64,)).square(),
    "group_norm": lambda t: F.group_norm(t.view(64, 8, 8) * 1.0, 2).square(),
    "batch_norm": lambda t: F.batch_norm(t.view(16, 4, 8, 8) * 1.0, None, None,
                                         training=True).square(),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", list(OPS))
def test_norm_rule(op, dtype):
    check(OPS[op], lambda t: t, dtype, shape=(64, 64))
