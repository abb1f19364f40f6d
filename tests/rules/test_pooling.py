"""Layer kinds that compress() converts keep nothing large exact; average pooling keeps
nothing; in-place SiLU saves its derivative."""

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

import actune
from tests.rules.helpers import exact_grads, input_grads, level, relative_error, shrinks_like_noise


def every_layer_kind() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(inplace=True),
        nn.Conv2d(32, 32, 3, padding=1), nn.GroupNorm(4, 32), nn.SiLU(inplace=True),
        nn.MaxPool2d(2), nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.GELU(),
        nn.Dropout(0.1), nn.ConvTranspose2d(64, 32, 2, stride=2), nn.LeakyReLU(0.1, True),
        nn.Conv2d(32, 32, 3, padding=1), nn.Hardtanh(), nn.Conv2d(32, 32, 1),
        nn.ReLU6(inplace=True), nn.Sigmoid(), nn.Conv2d(32, 16, 3, padding=1), nn.Tanh(),
        nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(256, 64), nn.LayerNorm(64),
        nn.Dropout(0.1), nn.Softmax(-1))


def test_a_cnn_of_every_converted_layer_kind_keeps_nothing_large_exact():
    model = every_layer_kind()
    x = torch.randn(16, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    counted = []
    with actune.compressed("L0",
                           stats=counted.append):
        model(x).sum().backward()
    actune.compress(model, "u2")
    st = []
    with actune.compressed("u2", stats=st.append):
        model(x).sum().backward()
    assert st[0].exact == {}, st[0].describe_exact()
    assert counted[0].saved_bytes / st[0].kept_bytes > 12  # measured 15.5x


POOLS = {
    "avg_pool2d": lambda t: F.avg_pool2d(t * 1.0, 3, 2, 1, count_include_pad=False),
    "avg_pool1d": lambda t: F.avg_pool1d(t.flatten(2) * 1.0, 4),
    "adaptive_avg_pool2d": lambda t: F.adaptive_avg_pool2d(t * 1.0, (3, 5)),
    "global_avg_pool": lambda t: F.adaptive_avg_pool2d(t * 1.0, 1),
    "global_avg_pool_unbatched": lambda t: F.adaptive_avg_pool2d(t[0] * 1.0, 1),
    "adaptive_avg_pool3d": lambda t: F.adaptive_avg_pool3d(t[:, None] * 1.0, 2),
}


@pytest.mark.parametrize("pool", list(POOLS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_average_pooling_keeps_nothing_and_its_gradient_is_exact(pool, dtype):
    fn = POOLS[pool]
    x = torch.randn(4, 8, 12, 12, generator=torch.Generator().manual_seed(0)).to(dtype)
    x.requires_grad_()
    (exact,) = exact_grads(fn, (x,))
    (got,) = input_grads(fn, (x,), "L3", 1)
    assert torch.equal(got[0], exact[0])
    st = []
    with actune.compressed("L3", stats=st.append):
        fn(x).sum().backward()
    assert st[0].kept_bytes == 0 and st[0].saved_bytes == 0


def test_inplace_silu_saves_its_derivative():
    def fn(t):
        return F.silu(t * 1.0, inplace=True)

    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(0)).requires_grad_()
    (exact,) = exact_grads(fn, (x,))
    (two,) = input_grads(fn, (x,), level(2), 512)
    assert relative_error(two[0], exact[0]) > 1e-3
    assert shrinks_like_noise(two, exact[0]) < 0.2
