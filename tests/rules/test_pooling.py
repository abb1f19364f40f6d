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


def _grid_case(dims: int, grid_grad: bool = True):
    """An input of ``dims`` (4: N, C, H, W; 5: a volume) and a grid reaching past its edges."""
    gen = torch.Generator().manual_seed(0)
    shape = (2, 6, 10, 12) if dims == 4 else (2, 4, 6, 7, 8)
    x = torch.randn(shape, generator=gen).requires_grad_()
    grid = torch.rand(2, 5, 7, *(() if dims == 4 else (3,)), dims - 2, generator=gen) * 2.4 - 1.2
    return x, grid.requires_grad_(grid_grad)


GRID_CASES = [(4, "bilinear", "zeros", False), (4, "bilinear", "border", True),
              (4, "bicubic", "reflection", False), (5, "bilinear", "zeros", True),
              (5, "bilinear", "reflection", False)]


@pytest.mark.parametrize(("dims", "mode", "padding", "align"), GRID_CASES)
def test_grid_sample_keeps_its_grid_exact_and_its_input_rounded_unbiased(dims, mode, padding,
                                                                         align):
    x, grid = _grid_case(dims)

    def fn(a, g):  # (activations, not leaves: a leaf that records gradients is a weight)
        return F.grid_sample(a * 1.0, g * 1.0, mode, padding, align)

    exact_x, exact_grid = exact_grads(fn, (x, grid))
    stats = []
    with actune.compressed(level(2), stats=stats.append):
        fn(x, grid)
    # the input packed, the grid kept exact under its own name
    assert stats[0].by_kind.get("grid_sample input", 0) > 0, stats[0].by_kind
    assert set(stats[0].exact) == {"grid_sample grid"}, stats[0].exact
    two_x, two_grid = input_grads(fn, (x, grid), level(2), 256)
    # the input's gradient reads the grid alone: PyTorch's, exactly, at any width
    assert torch.equal(two_x[0], exact_x[0]) and torch.equal(two_x[-1], exact_x[0])
    # the grid's is linear in the rounded input: noisy and unbiased
    assert relative_error(two_grid[0], exact_grid[0]) > 1e-3
    assert shrinks_like_noise(two_grid, exact_grid[0], small=8, large=256) < 0.25
    eight_x, eight_grid = input_grads(fn, (x, grid), level(8), 1)
    assert torch.equal(eight_x[0], exact_x[0])
    assert relative_error(eight_grid[0], exact_grid[0]) < 0.03


@pytest.mark.parametrize("case", ["nearest", "fixed grid"])
def test_grid_sample_keeps_nothing_of_its_input_where_no_grid_gradient_reads_it(case):
    x, grid = _grid_case(4, grid_grad=case != "fixed grid")
    mode = "nearest" if case == "nearest" else "bilinear"

    def fn(a, g):
        return F.grid_sample(a * 1.0, g * 1.0, mode, "zeros", False)

    inputs = (x, grid) if grid.requires_grad else (x,)
    call = fn if grid.requires_grad else (lambda a: fn(a, grid))
    exact = exact_grads(call, inputs)
    got = input_grads(call, inputs, "L3", 1)
    for e, g in zip(exact, got, strict=True):
        assert torch.equal(g[0], e[0])
    stats = []
    with actune.compressed(level(2), stats=stats.append):
        call(*inputs)
    assert "grid_sample input" not in stats[0].by_kind
    # what PyTorch keeps (the input, the grid) is counted; only the grid is kept
    assert stats[0].saved_bytes >= x.numel() * x.element_size()
    assert stats[0].kept_bytes <= grid.numel() * grid.element_size()


def test_grid_sample_under_autocast_returns_the_gradients_in_the_inputs_dtypes():
    x, grid = _grid_case(4)
    x16, grid16 = (t.detach().bfloat16().requires_grad_() for t in (x, grid))

    def step(scope) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.autocast("cpu", dtype=torch.bfloat16), scope:
            out = F.grid_sample(x16 * 1.0, grid16 * 1.0, align_corners=False)
        return torch.autograd.grad(out.float().sum(), (x16, grid16))

    gx, ggrid = step(actune.compressed("L0"))
    got_x, got_grid = step(actune.compressed("u8"))
    assert got_x.dtype == got_grid.dtype == torch.bfloat16
    assert torch.equal(got_x, gx)
    assert 0 < relative_error(got_grid.float(), ggrid.float()) < 0.05


ADAPTIVE_MAX = {
    "2d": (lambda t: F.adaptive_max_pool2d(t, (3, 5)), 1),
    "2d unbatched": (lambda t: F.adaptive_max_pool2d(t[0], 4), 1),
    "1d": (lambda t: F.adaptive_max_pool1d(t.flatten(2), 7), 1),
    "3d (a volume of 1,152)": (lambda t: F.adaptive_max_pool3d(t[:, None], 2), 2),
    "ties": (lambda t: F.adaptive_max_pool2d(t.round(), (5, 5)), 1),
    "a plane of 400": (lambda t: F.adaptive_max_pool2d(F.pad(t, (4, 4, 4, 4)), 3), 2),
}


@pytest.mark.parametrize("name", list(ADAPTIVE_MAX))
def test_adaptive_max_pooling_keeps_its_indices_in_the_narrowest_integers(name):
    """PyTorch keeps the input and int64 indices; the rule keeps the indices alone (one byte
    for a plane of up to 256 positions, two beyond), and the gradient is PyTorch's exactly."""
    pool, nbytes = ADAPTIVE_MAX[name]

    def fn(t):
        return pool(t * 1.0)

    x = torch.randn(4, 8, 12, 12, generator=torch.Generator().manual_seed(0)).requires_grad_()
    (exact,) = exact_grads(fn, (x,))
    (got,) = input_grads(fn, (x,), "L3", 1)
    assert torch.equal(got[0], exact[0])
    stats = []
    with actune.compressed("L3", stats=stats.append):
        out = fn(x)
    assert stats[0].exact == {} and set(stats[0].by_kind) == {"maxpool"}, stats[0]
    assert stats[0].kept_bytes == nbytes * out.numel()


def test_the_spatial_transformer_example_keeps_only_its_sampling_grid_exact():
    """docs/examples/spatial_transformer.py (grid sampling, adaptive max pooling, topk and a
    maximum in a user's own forward): at L3 only the sampling grid stays exact."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "docs" / "examples" / "spatial_transformer.py"
    spec = importlib.util.spec_from_file_location("spatial_transformer", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    torch.manual_seed(0)
    model = example.build_model()
    x, y = example.make_batch(16)
    stats = []
    with actune.compressed("L3", stats=stats.append):
        loss = F.cross_entropy(model(x), y)
    loss.backward()
    assert set(stats[0].exact) == {"grid_sample grid"}, stats[0].exact
    assert stats[0].ratio > 10, stats[0].ratio
