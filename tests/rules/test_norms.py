"""Norm rules: the input rounded, the statistics exact; gradients close at 8 bits and
unbiased at 2 bits (reductions of 64 and more elements), in float32 and bfloat16. Vector
2-norms and ``F.normalize`` alike; their other orders exact."""

import contextlib

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

import actune
from tests.rules.helpers import (
    DTYPES,
    check_rule,
    exact_grads,
    input_grads,
    level,
    relative_error,
    shrinks_like_noise,
)

OPS = {
    "layer_norm": lambda t: F.layer_norm(t * 1.0, (64,)).square(),
    "rms_norm": lambda t: F.rms_norm(t * 1.0, (64,)).square(),
    # torch's own spellings (what the inline RMSNorm runs as): the same rules
    "torch.layer_norm": lambda t: torch.layer_norm(t * 1.0, (64,)).square(),
    "torch.rms_norm": lambda t: torch.rms_norm(t * 1.0, (64,)).square(),
    "torch.group_norm": lambda t: torch.group_norm(t.view(64, 8, 8) * 1.0, 2).square(),
    "torch.batch_norm": lambda t: torch.batch_norm(t.view(16, 4, 8, 8) * 1.0, None, None, None,
                                                   None, True, 0.1, 1e-5, False).square(),
    "group_norm": lambda t: F.group_norm(t.view(64, 8, 8) * 1.0, 2).square(),
    # (computed as a batch norm of the input viewed as one sample: kept exact before)
    "instance_norm": lambda t: F.instance_norm(t.view(16, 4, 8, 8) * 1.0).square(),
    "torch.instance_norm": lambda t: torch.instance_norm(
        t.view(16, 4, 8, 8) * 1.0, None, None, None, None, True, 0.1, 1e-5, False).square(),
    "batch_norm": lambda t: F.batch_norm(t.view(16, 4, 8, 8) * 1.0, None, None,
                                         training=True).square(),
    # vector 2-norms (the input rounded, the norm exact) in each spelling, and F.normalize
    # (two copies of the input)
    "linalg.vector_norm": lambda t: torch.linalg.vector_norm(t * 1.0, dim=-1),
    "torch.norm": lambda t: torch.norm(t * 1.0, dim=-1),
    "Tensor.norm": lambda t: (t * 1.0).norm(2, dim=0, keepdim=True),
    "linalg.norm": lambda t: torch.linalg.norm(t * 1.0, dim=-1),
    "linalg.norm, ord 2 over one dim": lambda t: torch.linalg.norm(t * 1.0, 2, dim=0),
    "global response norm": lambda t: torch.linalg.vector_norm(
        t.view(4, 4, 4, 64) * 1.0, ord=2, dim=(1, 2), keepdim=True),  # (ConvNeXt V2's)
    "normalize": lambda t: F.normalize(t * 1.0, dim=-1),
    # variances and standard deviations: the input rounded, the result exact (kept exact
    # before); a hand-written layer norm (The Annotated Transformer's) divides by x.std(-1)
    "std": lambda t: (t * 1.0).std(-1),
    "var over rows": lambda t: torch.var(t * 1.0, dim=0, correction=0),
    "var_mean": lambda t: sum(torch.var_mean(t * 1.0, -1)),
    "std_mean, all": lambda t: torch.std_mean(t * 1.0)[0] * t.cos(),
    "hand-written layer norm": lambda t: ((t * 1.0 - t.mean(-1, keepdim=True))
                                          / ((t * 1.0).std(-1, keepdim=True) + 1e-6)).square(),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", list(OPS))
def test_norm_rule(op, dtype):
    check_rule(OPS[op], lambda t: t, dtype, shape=(64, 64))


def _norm_then(consumer: str):
    """A layer norm whose output ``consumer`` reads: a linear layer (its weight's gradient
    alone reads it), the same after an in-place change, or an elementwise square."""

    def fn(x, w, b, W):  # noqa: N803
        y = F.layer_norm(x * 1.0, (64,), w, b)
        if consumer == "inplace":
            y = y.mul_(2.0)
        return y.square() if consumer == "square" else F.linear(y, W)

    return fn


def _inputs(dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(16, 32, 64, generator=gen).to(dtype).requires_grad_()
    w = torch.nn.Parameter((1 + 0.5 * torch.randn(64, generator=gen)).to(dtype))
    b = torch.nn.Parameter((0.3 * torch.randn(64, generator=gen)).to(dtype))
    W = torch.nn.Parameter(torch.randn(48, 64, generator=gen).to(dtype) / 8)  # noqa: N806
    return x, w, b, W


@pytest.mark.parametrize(("consumer", "packed"), [("linear", 1), ("inplace", 2),
                                                   ("square", 2)])
def test_layer_norm_output_read_by_a_weight_matmul_is_rebuilt_from_the_norms_copy(consumer,
                                                                                  packed):
    # the pair keeps one packed tensor (the normalised input), not two, where only a weight's
    # gradient reads the output; an output changed in place, or read by an op whose input
    # gradient reads it (a product of one rounding with itself: biased), packs its own
    x, w, b, W = _inputs()  # noqa: N806
    seen = []
    with actune.compressed(level(2), stats=seen.append):
        _norm_then(consumer)(x, w, b, W)
    stats = seen[0]
    assert stats.packed == packed
    if consumer == "linear":  # what PyTorch keeps: the input, the output, rstd
        assert stats.saved_bytes == 2 * x.numel() * 4 + 16 * 32 * 4
        assert stats.kept_bytes < stats.saved_bytes / 12


@pytest.mark.parametrize("consumer", ["linear", "inplace"])
def test_layer_norm_and_linear_gradients_close_at_8_bits_unbiased_at_2(consumer):
    inputs = _inputs()
    fn = _norm_then(consumer)
    exact = exact_grads(fn, inputs)
    eight = input_grads(fn, inputs, level(8), 1)
    for e, g in zip(exact, eight, strict=True):
        assert relative_error(g[0], e[0]) < 0.03
    two = input_grads(fn, inputs, level(2), 256)
    for name, e, g in zip("xwbW", exact, two, strict=True):
        if name == "b":  # the bias's gradient reads no saved activation: exact
            assert relative_error(g[0], e[0]) < 1e-5
            continue
        assert relative_error(g[0], e[0]) > 1e-3  # rounded
        if name == "x":  # the norm's own bias, (rounding variance) / (features), PyTorch's too
            assert relative_error(g.mean(0), e[0]) < 0.025
            continue
        assert shrinks_like_noise(g, e[0], small=8, large=256) < 0.25, name


def test_layer_norm_and_linear_in_bfloat16_close_at_8_bits():
    inputs = _inputs(torch.bfloat16)
    fn = _norm_then("linear")
    exact = exact_grads(fn, inputs)
    eight = input_grads(fn, inputs, level(8), 1)
    for e, g in zip(exact, eight, strict=True):
        assert g.dtype == torch.bfloat16
        assert relative_error(g[0].float(), e[0].float()) < 0.08


def test_a_batch_norm_of_features_groups_each_features_values():
    """BatchNorm1d on ``[batch, features]`` (after a linear layer) normalises each feature over
    the batch: its input is packed one feature per group, so a feature's small spread is not
    rounded on the grid of its neighbours' offsets (20x its spread here). Grouped by rows, the
    same input's gradients at 4 bits were off by 105% (input) and 284% (weight)."""
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(256, 64, generator=gen) * 0.5
         + torch.randn(64, generator=gen) * 20).requires_grad_()
    w = torch.rand(64, generator=gen).add(0.5).requires_grad_()
    b = torch.zeros(64).requires_grad_()

    def fn(x, w, b):
        return F.batch_norm(x * 1, None, None, w, b, training=True)

    exact = exact_grads(fn, (x, w, b))
    draws = input_grads(fn, (x, w, b), level(4), 4)
    assert relative_error(draws[0].mean(0), exact[0]) < 0.03
    assert relative_error(draws[1].mean(0), exact[1]) < 0.2


def test_a_norms_large_statistics_stay_exact_and_are_named_as_statistics():
    """A channels-last layer norm over few features (ConvNeXt's) has one mean and rstd a
    position: over ``min_numel`` of them, kept exact (read nonlinearly) and reported as the
    norm's statistics, not as if its input were exact."""
    x = torch.randn(8, 16, 32, 32, requires_grad=True)
    stats = []
    with actune.compressed("L3", stats=stats.append):
        y = F.layer_norm((x * 1.0).permute(0, 2, 3, 1), (16,))
    y.square().sum().backward()
    rows = 8 * 32 * 32
    assert stats[0].exact == {"layer_norm statistics": rows * 4}  # (rstd, float32)
    assert stats[0].by_kind["norm"] > 0  # the normalised input: packed


@pytest.mark.parametrize(("name", "fn"), [
    ("linalg_vector_norm", lambda t: torch.linalg.vector_norm(t * 1.0, ord=1, dim=-1)),
    ("linalg_vector_norm", lambda t: torch.linalg.vector_norm(t * 1.0, ord=float("inf"))),
    ("norm", lambda t: torch.norm(t * 1.0, p=3, dim=-1)),
    ("linalg_norm", lambda t: torch.linalg.norm(t * 1.0, ord=2)),  # spectral
    ("linalg_vector_norm", lambda t: torch.linalg.vector_norm(t.view(64, 64, 1) * 1.0,
                                                              dim=-1)),  # |x| itself
    ("normalize", lambda t: F.normalize(t * 1.0, p=1, dim=-1)),
])
def test_norms_read_nonlinearly_stay_exact_and_named(name, fn):
    # other orders than 2 (and the spectral norm, a reduction over one element) read their
    # input through a nonlinearity: PyTorch's own, exact, gradients, named in the report
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0)).requires_grad_()
    stats = []
    (two,) = input_grads(fn, (x,), level(2), 1)
    with actune.compressed(level(2), stats=stats.append):
        fn(x)
    (exact,) = exact_grads(fn, (x,))
    assert torch.equal(two[0], exact[0])
    assert name in stats[0].exact, stats[0].exact


def test_normalize_is_unbiased_where_one_copy_would_not_be():
    # F.normalize's backward reads x twice (x <g, x>): one 2-bit copy adds its variance to the
    # product; two independent copies do not (a mean over 512 draws falls like noise)
    x = torch.randn(32, 16, generator=torch.Generator().manual_seed(3)).requires_grad_()

    def fn(t):
        return F.normalize(t * 1.0, dim=-1)

    (exact,) = exact_grads(fn, (x,))
    (two,) = input_grads(fn, (x,), level(2), 512)
    assert shrinks_like_noise(two, exact[0], small=8, large=512) < 0.2
    stats = []
    with actune.compressed(level(2), stats=stats.append):
        fn(x)
    assert stats[0].by_kind["normalize"] > 0  # the two copies; the norm alone exact:
    assert list(stats[0].exact) == ["normalize norm"] and stats[0].exact["normalize norm"] == 128


def test_a_normalized_weight_stays_a_reference():
    # a cosine classifier normalises its weight in forward: PyTorch saves the weight itself
    # (held by the module anyway); two rounded copies would add bytes and noise
    weight = torch.nn.Parameter(torch.randn(64, 64, generator=torch.Generator().manual_seed(1)))

    def fn(w):
        return F.normalize(w, dim=-1) * 2.0  # (a product with a number saves nothing)

    stats = []
    with actune.compressed(level(2), stats=stats.append):
        fn(weight)
    assert "normalize" not in stats[0].by_kind, stats[0].by_kind
    (two,) = input_grads(fn, (weight,), level(2), 1)
    (exact,) = exact_grads(fn, (weight,))
    assert torch.equal(two[0], exact[0])


@pytest.mark.parametrize("norm", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("view", [False, True], ids=["3-d", "viewed 2-d"])
def test_under_autocast_a_norms_copy_serves_the_matmuls_cast_copies_of_its_output(norm, view):
    # under autocast the norm runs in float32 and each linear layer saves its own bfloat16
    # copy of the output: those copies were rounded at 2 bits each beside the norm's raw input
    # (ViT's one-step L3 gradient error 1,169%, Llama's allocated 249%); now the norm keeps
    # its rounded x_hat and each copy is rebuilt from it, cast
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(8, 32, 64, generator=gen) * 3 + 5).requires_grad_()
    w = torch.nn.Parameter(1 + 0.5 * torch.randn(64, generator=gen))
    weights = [torch.nn.Parameter(torch.randn(48, 64, generator=gen) / 8) for _ in range(3)]

    def fn():
        y = (F.layer_norm(x * 1.0, (64,), w) if norm == "layer_norm"
             else F.rms_norm(x * 1.0, (64,), w))
        y = y.view(-1, 64) if view else y
        return sum(F.linear(y, W).float().sum() for W in weights)  # q, k, v (saves nothing)

    def grads(lv=None, seed=0):
        torch.manual_seed(seed)
        seen = []
        with (actune.compressed(lv, stats=seen.append) if lv else contextlib.nullcontext(),
              torch.autocast("cpu", dtype=torch.bfloat16)):
            out = fn()
        got = torch.autograd.grad(out, [x, w, *weights])
        return out, torch.cat([g.flatten().float() for g in got]), seen

    out, exact, _ = grads()
    same, _, _ = grads("L0")
    assert torch.equal(out, same)
    compressed_out, rounded, seen = grads("L3")
    assert torch.equal(out, compressed_out)  # (forward stays exact)
    stats = seen[0]
    assert stats.packed == 1, stats  # x_hat alone: the three cast copies rebuilt from it
    assert stats.kept_bytes < stats.saved_bytes / 8
    assert relative_error(rounded, exact) < 0.25  # (layer norm: 0.70 before, 0.15 now)


def _similarity_inputs():
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(48, 32, generator=gen).requires_grad_()
    w = torch.randn(48, 32, generator=gen).requires_grad_()
    return z, w


SIMILARITIES = {
    # a contrastive loss's similarity matrix: every row against every row, broadcast
    "matrix": lambda z, w: F.cosine_similarity(z[:, None] * 1.0, w[None] * 1.0, dim=-1),
    "rows": lambda z, w: torch.cosine_similarity(z * 1.0, w * 1.0),
}


@pytest.mark.parametrize("name", list(SIMILARITIES))
def test_a_cosine_similarity_keeps_its_inputs_size_not_the_broadcast_one(name):
    fn = SIMILARITIES[name]
    z, w = _similarity_inputs()
    expected = fn(z, w)
    plain, stats = [], []
    with actune.compressed("L0", stats=plain.append):
        fn(z, w)
    with actune.compressed("L3", stats=stats.append):
        got = fn(z, w)
    assert torch.equal(got, expected)  # (normalised before broadcasting: the same values)
    assert stats[0].exact == {} and stats[0].by_kind.get("sensitive", 0) > 0, stats[0]
    # PyTorch's composite keeps tensors of the broadcast shape, exact
    assert plain[0].saved_bytes > (40 if name == "matrix" else 4) * stats[0].kept_bytes
    exact = exact_grads(fn, (z, w))
    two = input_grads(fn, (z, w), level(2), 256)
    eight = input_grads(fn, (z, w), level(8), 1)
    for e, t, g in zip(exact, two, eight, strict=True):
        assert relative_error(g[0], e[0]) < 0.03
        assert relative_error(t[0], e[0]) > 1e-3
        assert shrinks_like_noise(t, e[0], small=8, large=256) < 0.25


def test_a_cosine_similarity_broadcast_along_its_dim_runs_as_pytorchs():
    z = torch.randn(16, 1, generator=torch.Generator().manual_seed(0)).requires_grad_()
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(1)).requires_grad_()
    stats = []
    with actune.compressed("L3", stats=stats.append):
        got = F.cosine_similarity(z * 1.0, w * 1.0, dim=1)
    assert torch.equal(got, F.cosine_similarity(z, w, dim=1))
    assert "cosine_similarity" in stats[0].exact


def test_a_product_of_normalized_vectors_takes_the_sensitive_width():
    """Cosine attention's scores and a contrastive loss's similarities spelled
    ``normalize(a) @ normalize(b).T``: both operands unit vectors, kept at the level's
    sensitive width (4 bits at L3), not the matmul rule's 2, and still unbiased."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(2, 64, 32, generator=gen).requires_grad_()
    b = torch.randn(2, 64, 32, generator=gen).requires_grad_()

    def fn(x, y):
        return F.normalize(x * 1.0, dim=-1) @ F.normalize(y * 1.0, dim=-1).transpose(-2, -1)

    stats = []
    with actune.compressed("L3", stats=stats.append):
        fn(a, b)
    # the two operands, 2 x 64 x 32 each, at 4 bits and their groups' two 16-bit words
    assert stats[0].by_kind.get("sensitive", 0) == 2 * (2 * 64 * 32 // 2 + 2 * 64 * 32 // 256 * 4)
    # a product of two other activations keeps the matmul rule's width
    plain = []
    with actune.compressed("L3", stats=plain.append):
        (a * 1.0) @ (b * 1.0).transpose(-2, -1)
    assert "sensitive" not in plain[0].by_kind and plain[0].by_kind.get("matmul", 0) > 0
    exact = exact_grads(fn, (a, b))
    four = input_grads(fn, (a, b), "L3", 128)
    for e, f in zip(exact, four, strict=True):
        assert shrinks_like_noise(f, e[0], small=8, large=128) < 0.35
