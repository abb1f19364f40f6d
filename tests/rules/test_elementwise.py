"""Elementwise rules: each op's input gradient is close at 8 bits and unbiased at 2 bits, and
what it saves is packed (not kept exact)."""

import math

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

import actune
from actune.rules import RULES
from tests.rules.helpers import exact_grads, input_grads, level, relative_error, shrinks_like_noise


def gelu_new(x):  # GPT-2's activation, as Hugging Face writes it
    c = math.sqrt(2.0 / math.pi)
    return 0.5 * x * (1.0 + torch.tanh(c * (x + 0.044715 * torch.pow(x, 3.0))))


def rms_norm(x):  # Llama's RMSNorm, as Hugging Face writes it (weight 1)
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    return (h * torch.rsqrt(variance + 1e-6)).to(x.dtype)


def rotary(x):  # rotate_half and cos / sin, as Llama writes them
    pos = torch.arange(x.shape[-2], dtype=torch.float32)[:, None] * torch.arange(1, x.shape[-1] + 1)
    cos, sin = pos.cos(), pos.sin()
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


OPS = {
    "gelu_new": (gelu_new, lambda t: t),
    # (an activation: a leaf's float32 cast is itself, kept as a reference; the per-row
    # statistic is kept exact, so only the input is rounded: its two readers, pow and the
    # product, share one rounding, a bias of O(variance / row width), as a norm's)
    "rms_norm": (lambda t: rms_norm(t * 1.0), lambda t: t),
    "rotary": (rotary, lambda t: t),
    "swiglu": (lambda t: torch.nn.functional.silu(t[..., :32]) * t[..., 32:], lambda t: t),
    "exp": (torch.exp, lambda t: t.tanh()),
    "erf": (torch.erf, lambda t: t),
    "sqrt": (torch.sqrt, lambda t: t.abs() + 0.5),
    "rsqrt": (torch.rsqrt, lambda t: t.abs() + 0.5),
    "reciprocal": (torch.reciprocal, lambda t: t.abs() + 0.5),
    "log": (torch.log, lambda t: t.abs() + 0.5),
    "sin_cos": (lambda t: t.sin() * t.cos(), lambda t: t),
    "pow3": (lambda t: t ** 3, lambda t: t),
    # (t * 1.0: a leaf's saved value stays a reference, as parameters do)
    "square": (lambda t: (t * 1.0).square() + (t * 1.0).pow(2), lambda t: t),
    "clamp": (lambda t: t.clamp(-0.5, 0.7), lambda t: t),
    # a division by an activation: the dividend rounded, the divisor exact (before: both)
    "divide": (lambda t: (t * 1.0) / (t.square().mean(-1, keepdim=True) + 1), lambda t: t),
    "true_divide": (lambda t: torch.true_divide(t.sin(), t.cos().abs().sum(0) + 1),
                    lambda t: t),
    # logsumexp keeps exp(x - result), a softmax (its input and result exact before)
    "logsumexp": (lambda t: torch.logsumexp(t * 2, -1), lambda t: t),
    "logsumexp_keepdim": (lambda t: (t * 1.0).logsumexp((0, 1), keepdim=True) * t.cos(),
                          lambda t: t),
    # other spellings of ops with rules (ConvBERT's torch.multiply was kept exact)
    "multiply": (lambda t: torch.multiply(t, t.tanh()), lambda t: t),
    "multiply_method": (lambda t: t.sin().multiply(t.cos()), lambda t: t),
    "expit": (torch.special.expit, lambda t: t),
    "special_softmax": (lambda t: torch.special.softmax(t, -1), lambda t: t),
    "special_log_softmax": (lambda t: torch.special.log_softmax(t, -1) * t.cos(), lambda t: t),
}


def _input(make, shape=(16, 64), seed=0):
    x = make(torch.randn(shape, generator=torch.Generator().manual_seed(seed)))
    return x.requires_grad_()


@pytest.mark.parametrize("op", list(OPS))
def test_close_at_8_bits_unbiased_at_2(op):
    fn, make = OPS[op]
    x = _input(make, (8, 1024) if op == "rms_norm" else (16, 64))  # (rows as wide as a model's)
    (exact,) = exact_grads(fn, (x,))
    (eight,) = input_grads(fn, (x,), level(8), 1)
    assert relative_error(eight[0], exact[0]) < 0.03
    (two,) = input_grads(fn, (x,), level(2), 512)
    if op == "clamp":  # a mask: exact, not rounded
        assert torch.equal(two[0], exact[0])
        return
    assert relative_error(two[0], exact[0]) > 1e-3  # it was rounded
    assert shrinks_like_noise(two, exact[0]) < 0.2


@pytest.mark.parametrize("op", list(OPS))
def test_nothing_large_stays_exact(op):
    fn, make = OPS[op]
    x = _input(make, (64, 64))
    st = []
    with actune.compressed(level(2).with_(min_numel=1024), stats=st.append):
        y = fn(x * 1.0)  # a non-leaf input, as inside a model
    y.sum().backward()
    assert st[0].exact == {}, st[0].exact
    assert st[0].ratio > 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tensor_exponents_and_out_of_place_arguments_fall_back_exactly(dtype):
    x = _input(lambda t: t.abs().to(dtype) + 0.5)
    e = torch.full_like(x, 1.5).requires_grad_()
    fn = torch.pow
    exact = exact_grads(fn, (x, e))
    got = input_grads(fn, (x, e), level(2), 1)
    for a, b in zip(got, exact, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(("rows", "padding_idx", "scale", "width"),
                         [(200, None, False, 1), (300, 3, False, 2), (40000, -1, True, 4)])
def test_embedding_indices_in_the_narrowest_type_its_table_needs(rows, padding_idx, scale,
                                                                  width):
    """uint8 up to 256 rows (T5's relative-position buckets), int16 up to 32,768, else int32:
    the weight's gradient is PyTorch's exactly."""
    w = torch.randn(rows, 16, requires_grad=True)
    ids = torch.randint(0, rows, (64, 32), generator=torch.Generator().manual_seed(0))
    g = torch.randn(64, 32, 16, generator=torch.Generator().manual_seed(1))
    (F.embedding(ids, w, padding_idx, scale_grad_by_freq=scale) * g).sum().backward()
    exact, w.grad = w.grad.clone(), None
    st = []
    with actune.compressed("L3", stats=st.append):
        y = F.embedding(ids, w, padding_idx, scale_grad_by_freq=scale)
    (y * g).sum().backward()
    assert torch.equal(w.grad, exact)
    assert st[0].by_kind == {"embedding indices": ids.numel() * width} and st[0].exact == {}


@pytest.mark.parametrize(("size", "width", "spelling"),
                         [(64, 1, "function"), (300, 2, "method"), (40000, 4, "function")])
def test_gather_keeps_its_index_in_the_narrowest_type_and_not_its_input(size, width,
                                                                        spelling):
    """ViTMAE's token shuffle: ``gather(x, 1, ids.unsqueeze(-1).repeat(1, 1, dim))``. PyTorch
    keeps ``x`` and the int64 index; the rule keeps the index alone, in uint8 up to 256
    positions, int16 up to 32,768, else int32, and the input's gradient is PyTorch's exactly
    (a negative ``dim`` too)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, size, 16, generator=gen, requires_grad=True)
    ids = torch.randint(0, size, (2, 48), generator=gen)
    index = ids.unsqueeze(-1).repeat(1, 1, 16)
    g = torch.randn(2, 48, 16, generator=gen)

    def fn(t):
        return torch.gather(t * 1.0, -2, index) if spelling == "function" else \
            (t * 1.0).gather(1, index)

    (fn(x) * g).sum().backward()
    exact, x.grad = x.grad.clone(), None
    st = []
    with actune.compressed("L3", stats=st.append):
        y = fn(x)
    (y * g).sum().backward()
    assert torch.equal(x.grad, exact)
    assert st[0].by_kind == {"gather indices": index.numel() * width} and st[0].exact == {}
    assert st[0].saved_bytes == index.numel() * 8 + x.numel() * 4  # what PyTorch keeps


def test_a_divisor_stays_exact_and_a_broadcast_dividend_too():
    """``a / b``: ``b`` is read as ``1 / b`` and ``1 / b**2``, never rounded; ``a`` broadcast
    over ``b`` stays exact, as a product's broadcast operand does."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(64, 64, generator=gen, requires_grad=True)
    b = (torch.rand(64, 64, generator=gen) + 1).requires_grad_()
    for fn, exact in ((lambda: (a * 1.0) / (b * 1.0), {"div divisor"}),
                      (lambda: (a[:1] * 1.0) / (b * 1.0), {"div divisor",
                                                            "div broadcast dividend"})):
        st = []
        with actune.compressed(level(2).with_(min_numel=16), stats=st.append):
            y = fn()
        y.sum().backward()
        assert set(st[0].exact) == exact, st[0].exact


@pytest.mark.parametrize("test", ["isfinite", "Tensor.isfinite", "isclose"])
def test_a_test_of_values_keeps_nothing(test, monkeypatch):
    """``torch.isfinite`` and the like are built from ``abs``, whose node would save its input
    for a backward that never runs: under compressed() they record nothing."""
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0)).requires_grad_()
    y = x * 2  # (an activation, not a leaf)
    calls = {"isfinite": lambda t: torch.isfinite(t), "Tensor.isfinite": lambda t: t.isfinite(),
             "isclose": lambda t: torch.isclose(t, t * 1.5)}
    funcs = {"isfinite": torch.isfinite, "Tensor.isfinite": torch.Tensor.isfinite,
             "isclose": torch.isclose}
    stats = []
    with monkeypatch.context() as without_rule:
        without_rule.delitem(RULES, funcs[test])
        with actune.compressed("L3", stats=stats.append):
            expected = calls[test](y)
    assert stats[0].saved_bytes > 0  # PyTorch's own ops save the input while they run
    stats = []
    with actune.compressed("L3", stats=stats.append):
        got = calls[test](y)
    assert torch.equal(got, expected)
    assert stats[0].saved_bytes == 0 and stats[0].kept_bytes == 0, stats[0]


SELECTIONS = {
    "topk": lambda t: torch.topk(t, 5, dim=-1),
    "topk smallest, method": lambda t: t.topk(5, 0, largest=False),
    "sort": lambda t: torch.sort(t, dim=0, descending=True),
    "sort stable": lambda t: torch.sort(t, stable=True, dim=-1),
    "max along a dim": lambda t: torch.max(t, 1),
    "max keepdim, method": lambda t: t.max(dim=0, keepdim=True),
    "min along a dim": lambda t: torch.min(t, dim=-1),
    "kthvalue": lambda t: torch.kthvalue(t, 3, 1),
    "median along a dim": lambda t: torch.median(t, dim=1),
    "mode": lambda t: torch.mode(t.round(), dim=1),
    "cummax": lambda t: torch.cummax(t, dim=1),
    "cummin, method": lambda t: t.cummin(0),
}


@pytest.mark.parametrize("name", list(SELECTIONS))
def test_a_selection_keeps_its_indices_in_the_narrowest_integers(name):
    """topk, sort, max along a dim...: PyTorch keeps int64 indices (and cummax its input);
    the rule keeps the indices in one byte for 100 positions, and the values' gradient is
    PyTorch's exactly."""
    fn = SELECTIONS[name]
    x = torch.randn(64, 100, generator=torch.Generator().manual_seed(0)).requires_grad_()
    expected = fn(x * 1.0)
    stats = []
    with actune.compressed("L3", stats=stats.append):
        got = fn(x * 1.0)
    assert type(got) is type(expected) and torch.equal(got.indices, expected.indices)
    assert torch.equal(got.values, expected.values)
    assert stats[0].exact == {} and set(stats[0].by_kind) == {"selection indices"}
    assert stats[0].kept_bytes == expected.indices.numel()  # (uint8: 100 positions)
    g = torch.randn(expected.values.shape, generator=torch.Generator().manual_seed(1))
    (exact,) = torch.autograd.grad(expected.values, x, g)
    (found,) = torch.autograd.grad(got.values, x, g)
    assert torch.equal(found, exact)


def test_a_sort_over_more_than_256_positions_keeps_two_byte_indices():
    x = torch.randn(4, 300, generator=torch.Generator().manual_seed(0)).requires_grad_()
    stats = []
    with actune.compressed("L3", stats=stats.append):
        values = torch.sort(x * 1.0, dim=1).values
    assert stats[0].kept_bytes == 2 * x.numel()
    g = torch.randn(values.shape, generator=torch.Generator().manual_seed(1))
    (found,) = torch.autograd.grad(values, x, g)
    (exact,) = torch.autograd.grad(torch.sort(x * 1.0, dim=1).values, x, g)
    assert torch.equal(found, exact)
