"""Losses: cross entropy keeps its probabilities packed; the loss value is PyTorch's, the
logits' gradient close at 8 bits and unbiased at 2."""

import warnings

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

import actune
from actune import tunables
from actune.rules import losses
from actune.substitutes.functions import index_dtype
from tests.rules.helpers import exact_grads, input_grads, level, relative_error, shrinks_like_noise

TARGET = torch.randint(0, 300, (32,), generator=torch.Generator().manual_seed(1))
TARGET[::7] = -100  # ignored rows
WEIGHT = torch.rand(300, generator=torch.Generator().manual_seed(2)) + 0.5

CASES = {
    "mean": {},
    "sum": {"reduction": "sum"},
    "none": {"reduction": "none"},
    "weight": {"weight": WEIGHT},
    "smoothing": {"label_smoothing": 0.1},
    "ignore_other": {"ignore_index": 3},
}


def loss(kwargs):
    target = TARGET.clamp(min=0) if "ignore_index" in kwargs else TARGET
    return lambda x: F.cross_entropy(x * 1.0, target, **kwargs)


def logits(dtype=torch.float32):
    x = torch.randn(32, 300, generator=torch.Generator().manual_seed(0)) * 3
    return x.to(dtype).requires_grad_()


def _pytorchs_value(fn, x: torch.Tensor, lv) -> actune.CompressionStats:
    """``fn(x)`` under ``compressed(lv)`` is PyTorch's value; the step's statistics."""
    with torch.no_grad():
        ref = fn(x)
    st = []
    with actune.compressed(lv, stats=st.append), torch.enable_grad():
        got = fn(x)
    torch.testing.assert_close(got, ref)
    return st[0]


@pytest.mark.parametrize("case", list(CASES))
def test_value_is_pytorchs_and_gradient_unbiased(case):
    fn = loss(CASES[case])
    x = logits()
    with torch.no_grad():
        ref = fn(x)
    with actune.compressed("L3"), torch.enable_grad():
        got = fn(x)
    torch.testing.assert_close(got, ref)
    (exact,) = exact_grads(fn, (x,))
    (eight,) = input_grads(fn, (x,), level(8), 1)
    assert relative_error(eight[0], exact[0]) < 0.02
    (two,) = input_grads(fn, (x,), level(2), 256)
    assert relative_error(two[0], exact[0]) > 1e-3
    assert shrinks_like_noise(two, exact[0], large=256) < 0.25  # unbiased: about 0.18


@pytest.mark.parametrize("kwargs", [{}, {"label_smoothing": 0.1}, {"reduction": "none"}])
def test_loss_is_exact_where_a_targets_probability_underflows(kwargs):
    """Logit gaps of 200 (probabilities under float32's range): the loss is PyTorch's
    (the log-probabilities' value), finite, ignored rows included."""
    x = logits() * 0
    with torch.no_grad():
        x[:, 5] = 200.0  # every other class's probability is exp(-200)
        x[::3, 7] = -150.0
    fn = loss(kwargs)
    with torch.no_grad():
        ref = fn(x)
    with actune.compressed("L3"), torch.enable_grad():
        got = fn(x)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, ref)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_the_one_pass_form_matches_the_log_softmax_form(smoothing):
    """The CPU's softmax pass and the log-softmax form (a GPU's: no check that would wait
    for the device) give the same probabilities and losses."""
    x = logits().detach()
    target = TARGET.clamp(min=0)[:, None]
    p1, l1 = losses._probabilities(x, target, smoothing, True)
    p2, l2 = losses._probabilities(x, target, smoothing, False)
    torch.testing.assert_close(p1, p2)
    torch.testing.assert_close(l1, l2)


def test_log_softmax_then_nll_loss_is_unbiased():
    def fn(x):
        return F.nll_loss(F.log_softmax(x * 1.0, dim=-1), TARGET.clamp(min=0))

    x = logits()
    (exact,) = exact_grads(fn, (x,))
    (two,) = input_grads(fn, (x,), level(2), 256)
    assert shrinks_like_noise(two, exact[0], large=256) < 0.25


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_keeps_packed_probabilities_in_slices(dtype, monkeypatch):
    monkeypatch.setattr(tunables, "LOSS_SLICE", 300 * 6)  # 6 rows a slice: 6 slices
    x = logits(dtype)
    st = []
    with actune.compressed("L3", stats=st.append):
        out = F.cross_entropy(x * 1.0, TARGET)
    out.backward()
    assert st[0].exact == {} and "cross_entropy" in st[0].by_kind
    assert st[0].packed >= 6
    with torch.no_grad():
        assert x.grad.dtype == dtype and torch.isfinite(x.grad).all()


def test_class_probability_targets_fall_back_to_pytorch():
    x = logits()
    target = torch.softmax(torch.randn(32, 300), -1)
    fn = lambda t: F.cross_entropy(t * 1.0, target)  # noqa: E731
    (exact,) = exact_grads(fn, (x,))
    (got,) = input_grads(fn, (x,), level(2), 1)
    assert torch.equal(got[0], exact[0])


@pytest.mark.parametrize(("name", "bits"), [("L3", 4), ("u2", 2), ("L2", 4)])
def test_probabilities_are_packed_at_the_levels_sensitive_bits(name, bits):
    # their noise reaches every gradient of the step: L3 keeps them at 4 bits, u2 at 2
    x = logits()
    st = []
    with actune.compressed(name, stats=st.append):
        F.cross_entropy(x * 1.0, TARGET.clamp(min=0))
    groups = -(-x.numel() // 256)
    assert st[0].by_kind["cross_entropy"] == groups * (256 * bits // 8 + 4)  # codes, meta


#: (N, C, H, W) logits against (N, H, W) targets: a segmentation's loss.
PIXEL_TARGET = torch.randint(0, 12, (2, 16, 16), generator=torch.Generator().manual_seed(3))
PIXEL_TARGET[:, 0] = 255  # ignored pixels (a segmentation's border class)
PIXEL_CASES = {
    "mean": {"ignore_index": 255},
    "none": {"ignore_index": 255, "reduction": "none"},
    "weight": {"ignore_index": 255, "weight": WEIGHT[:12]},
    "smoothing": {"ignore_index": 255, "label_smoothing": 0.1},
}


def pixel_logits() -> torch.Tensor:
    x = torch.randn(2, 12, 16, 16, generator=torch.Generator().manual_seed(4)) * 3
    return x.requires_grad_()


@pytest.mark.parametrize("case", list(PIXEL_CASES))
def test_per_position_logits_keep_packed_probabilities_and_an_unbiased_gradient(case):
    """Logits with the classes along dimension 1 and positions after them (a segmentation's)
    take the same rule, as rows of classes: PyTorch's value and shape, nothing exact, the
    gradient close at 8 bits and unbiased at 2."""
    kwargs = PIXEL_CASES[case]
    fn = lambda x: F.cross_entropy(x * 1.0, PIXEL_TARGET, **kwargs)  # noqa: E731
    x = pixel_logits()
    stats = _pytorchs_value(fn, x, "L3")
    assert stats.exact == {} and stats.by_kind["cross_entropy"] > 0
    (exact,) = exact_grads(fn, (x,))
    (eight,) = input_grads(fn, (x,), level(8), 1)
    assert relative_error(eight[0], exact[0]) < 0.02
    (two,) = input_grads(fn, (x,), level(2), 256)
    assert shrinks_like_noise(two, exact[0], large=256) < 0.25


def test_mismatched_per_position_targets_fall_back_to_pytorchs_error():
    x = pixel_logits()
    with actune.compressed("L3"), pytest.raises(RuntimeError):
        F.cross_entropy(x * 1.0, PIXEL_TARGET[:, :9])


@pytest.mark.parametrize(("classes", "dtype"), [(12, torch.uint8), (255, torch.uint8),
                                                 (300, torch.int16), (40_000, torch.int32)])
def test_targets_are_kept_in_the_narrowest_integers_and_counted(classes, dtype):
    """PyTorch keeps int64 targets beside the log-probabilities; the rule keeps each row's
    class in the narrowest integer type holding it and one more value (an ignored row's), and
    the statistics count both sides."""
    rows = 256
    x = torch.randn(rows, classes, generator=torch.Generator().manual_seed(0))
    x.requires_grad_()
    target = torch.randint(0, classes, (rows,), generator=torch.Generator().manual_seed(1))
    target[::5] = -100
    st = []
    with actune.compressed("L3", stats=st.append):
        F.cross_entropy(x * 1.0, target).backward()
    kept = st[0].by_kind["cross_entropy targets"]
    assert kept == rows * dtype.itemsize
    assert st[0].saved_bytes == x.numel() * 4 + rows * 8  # log-probabilities, int64 targets
    assert index_dtype(classes + 1) is dtype


#: Elementwise losses of an input and a target: the target requires a gradient in "mirrored"
#: cases (a regression toward another activation).
_PW = torch.rand(16, generator=torch.Generator().manual_seed(6)) + 0.5
ELEMENTWISE = {
    "mse": (F.mse_loss, {}),
    "mse_sum": (F.mse_loss, {"reduction": "sum"}),
    "mse_none": (F.mse_loss, {"reduction": "none"}),
    "l1": (F.l1_loss, {}),
    "smooth_l1": (F.smooth_l1_loss, {"beta": 0.5}),
    "huber": (F.huber_loss, {"delta": 0.7}),
    "bce_with_logits": (F.binary_cross_entropy_with_logits, {}),
    "bce_weighted": (F.binary_cross_entropy_with_logits, {"weight": _PW, "pos_weight": _PW}),
    "kl_div": (F.kl_div, {"reduction": "batchmean"}),
    "kl_div_log_target": (F.kl_div, {"reduction": "sum", "log_target": True}),
}


@pytest.mark.parametrize("case", list(ELEMENTWISE))
def test_elementwise_losses_keep_their_rounded_derivative(case):
    """PyTorch kept the input and the target exact; the rule keeps the derivative at
    ``sensitive_bits``: the value is PyTorch's, the gradients (the target's too, where it has
    one) close at 8 bits and unbiased at 2."""
    func, kwargs = ELEMENTWISE[case]
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(64, 16, generator=gen).requires_grad_()
    if func is F.kl_div:  # (a teacher's probabilities, or their logarithms)
        target = torch.softmax(torch.randn(64, 16, generator=gen), -1)
        target = target.log() if kwargs.get("log_target") else target
    elif func is F.binary_cross_entropy_with_logits:
        target = torch.rand(64, 16, generator=gen)
    else:
        target = torch.randn(64, 16, generator=gen).requires_grad_()
    inputs = (x, target) if target.requires_grad else (x,)

    def fn(a, b=target):
        return func(a * 1.0, b * 1.0 if b.requires_grad else b, **kwargs)

    stats = _pytorchs_value(fn, x, level(2))
    assert stats.exact == {} and stats.by_kind == {"loss derivative": 64 * 16 // 4 + 4 * 4}
    exact = exact_grads(fn, inputs)
    eight = input_grads(fn, inputs, level(8), 1)
    two = input_grads(fn, inputs, level(2), 256)
    for e, g8, g2 in zip(exact, eight, two, strict=True):
        assert relative_error(g8[0], e[0]) < 0.02
        assert shrinks_like_noise(g2, e[0], large=256) < 0.25


def test_broadcast_or_legacy_arguments_fall_back_to_pytorch():
    x = torch.randn(64, 16, requires_grad=True)
    for call in (lambda: F.mse_loss(x * 1.0, torch.randn(16)),  # (broadcast: PyTorch warns)
                 lambda: F.mse_loss(x * 1.0, torch.randn(64, 16), reduce=False),
                 lambda: F.mse_loss(x * 1.0, torch.randn(64, 16), weight=torch.rand(64, 16))):
        st = []
        with actune.compressed("L3", stats=st.append), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            call()
        assert "loss derivative" not in st[0].by_kind


def test_a_weighted_l1_loss_keeps_its_weight():
    """``F.l1_loss`` hands a function mode its call without its ``weight`` (torch 2.13): the
    rule finds it where the caller gave it, and the loss and gradient are PyTorch's."""
    x = torch.tensor([1.0, 2.0, 3.0, 4.0] * 512, requires_grad=True)
    target, weight = torch.zeros(2048), torch.tensor([2.0, 0.0, 0.0, 0.0] * 512)
    ref = F.l1_loss(x * 1.0, target, weight=weight)
    (exact,) = torch.autograd.grad(ref, x)
    with actune.compressed("L3"):
        got = F.l1_loss(x * 1.0, target, weight=weight)
    torch.testing.assert_close(got, ref)
    torch.testing.assert_close(torch.autograd.grad(got, x)[0], exact)


def _ctc_case(case: str):
    gen = torch.Generator().manual_seed(7)
    frames, batch, classes = 40, 3, 12
    logits = torch.randn(frames, batch, classes, generator=gen)
    lengths = torch.tensor([18, 9, 13])
    padded = torch.randint(1, classes, (batch, 18), generator=gen)
    kwargs = {"mean": {}, "sum": {"reduction": "sum"}, "none": {"reduction": "none"},
              "concatenated": {"zero_infinity": True}}[case]
    targets = (torch.cat([padded[i, :n] for i, n in enumerate(lengths.tolist())])
               if case == "concatenated" else padded)
    input_lengths = torch.tensor([40, 31, 36])

    def fn(x):
        return F.ctc_loss(F.log_softmax(x * 1.0, -1), targets, input_lengths, lengths, **kwargs)

    return fn, logits.requires_grad_()


@pytest.mark.parametrize("case", ["mean", "sum", "none", "concatenated"])
def test_ctc_keeps_its_gradient_rounded(case):
    """Speech recognition's CTC loss kept its log-probabilities and forward variables exact;
    the rule keeps the gradient of each sample's loss, computed in forward: PyTorch's value,
    the gradient close at 8 bits and unbiased at 2, and PyTorch's forward variables counted
    as what it would keep."""
    fn, x = _ctc_case(case)
    stats = _pytorchs_value(fn, x, level(2))
    assert stats.exact == {} and stats.by_kind["ctc_loss gradient"] > 0
    # log-probabilities, and the forward variables: frames x batch x (2 x 18 + 1) floats
    assert stats.saved_bytes >= x.numel() * 4 + 40 * 3 * 37 * 4
    (exact,) = exact_grads(fn, (x,))
    (eight,) = input_grads(fn, (x,), level(8), 1)
    assert relative_error(eight[0], exact[0]) < 0.03
    (two,) = input_grads(fn, (x,), level(2), 256)
    assert shrinks_like_noise(two, exact[0], large=256) < 0.25


@pytest.mark.parametrize("pixels", [False, True], ids=["rows", "per_pixel"])
@pytest.mark.parametrize("kwargs", [{}, {"reduction": "sum"}, {"reduction": "none"},
                                    {"ignore_index": 3}, {"weight": WEIGHT[:10]}],
                         ids=["mean", "sum", "none", "ignore_index", "weight"])
def test_nll_loss_keeps_compact_targets_and_pytorchs_gradient(kwargs, pixels):
    """``nll_loss`` kept int64 targets; the rule keeps a byte a target (below 256 classes) and
    no input, and its value and gradient are PyTorch's exactly (nothing rounded there; the
    log-softmax before it exact at a level with no ``other_bits``)."""
    gen = torch.Generator().manual_seed(8)
    shape, target_shape = ((4, 10, 16, 16), (4, 16, 16)) if pixels else ((256, 10), (256,))
    x = torch.randn(shape, generator=gen).requires_grad_()
    target = torch.randint(0, 10, target_shape, generator=gen)

    def fn(t):
        return F.nll_loss(F.log_softmax(t * 1.0, 1), target, **kwargs)

    lv = actune.get_level("L3").with_(other_bits=None, min_numel=16)
    stats = _pytorchs_value(fn, x, lv)
    assert stats.by_kind["nll_loss targets"] == target.numel()
    (exact,) = exact_grads(fn, (x,))
    (got,) = input_grads(fn, (x,), lv, 1)
    torch.testing.assert_close(got[0], exact[0], rtol=0, atol=0)
