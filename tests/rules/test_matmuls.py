"""Matmul rules: every spelling keeps its activation rounded; gradients close at 8 bits,
unbiased at 2 bits, in float32 and bfloat16."""

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

import actune
from actune.session import packer as keeping
from actune.session.hooks import feature_major
from tests.rules.helpers import DTYPES, check_rule, level, shrinks_like_noise

_W = torch.randn(64, 48, generator=torch.Generator().manual_seed(7)) / 8
_B = torch.zeros(48)
#: the weights of the ops that take one (linear, convolutions) are parameters, as a layer's
#: are: any other tensor there stays exact (test_a_weight_computed_in_forward_is_never_rounded)
_LINEAR = torch.nn.Parameter(_W.t().contiguous())
_C = torch.nn.Parameter(torch.randn(6, 4, 3, 3, generator=torch.Generator().manual_seed(8)) / 4)
_C_T = torch.nn.Parameter(_C.detach().transpose(0, 1).contiguous())
_OFFSETS = torch.tensor([3, 8, 8, 16], dtype=torch.int32)  # (an expert with no token)

OPS = {
    "linear": lambda t: F.linear(t, _LINEAR.to(t.dtype)).square(),
    "matmul_operator": lambda t: (t @ _W.to(t.dtype)).square(),
    "addmm": lambda t: torch.addmm(_B.to(t.dtype), t * 1.0, _W.to(t.dtype)).square(),
    "baddbmm": lambda t: torch.baddbmm(_B.to(t.dtype), t.view(4, 4, 64) * 1.0,
                                       _W.to(t.dtype).expand(4, 64, 48)).square(),
    "einsum": lambda t: torch.einsum("ij,jk->ik", t * 1.0, _W.to(t.dtype)).square(),
    # the operands as one list (Longformer's sliding-window scores): kept exact before
    "einsum_listed": lambda t: torch.einsum("ij,kj->ik", [t * 1.0, t.tanh()]).square(),
    "self_product": lambda t: (t @ t.transpose(-1, -2)).square(),
    "conv2d": lambda t: F.conv2d(t.view(4, 4, 8, 8) * 1.0, _C.to(t.dtype), padding=1).square(),
    "conv_transpose2d": lambda t: F.conv_transpose2d(
        t.view(4, 4, 8, 8) * 1.0, _C_T.to(t.dtype)).square(),
    # a mixture-of-experts layer's tokens, sorted by expert, times each expert's weight
    "grouped_mm": lambda t: F.grouped_mm(t * 1.0, _W.to(t.dtype).expand(4, 64, 48),
                                         offs=_OFFSETS).square(),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", list(OPS))
def test_matmul_rule(op, dtype):
    check_rule(OPS[op], lambda t: t, dtype)


def test_experts_grouped_matmul_keeps_its_tokens_rounded_and_weight_gradients_unbiased():
    # Hugging Face's experts: F.grouped_mm of the routed tokens and each expert's weight (a
    # transposed view of one [experts, out, in] parameter): the tokens packed by feature, the
    # weight a reference, every expert's weight gradient unbiased
    gen = torch.Generator().manual_seed(4)
    weight = torch.nn.Parameter(torch.randn(4, 48, 64, generator=gen) / 8)
    x = torch.randn(256, 64, generator=gen).requires_grad_()
    offsets = torch.tensor([40, 100, 180, 256], dtype=torch.int32)
    g = torch.randn(256, 48, generator=gen)

    def grad(lv, stats=None):
        weight.grad = None
        with actune.compressed(lv, stats=stats):
            out = F.grouped_mm(x * 1.0, weight.transpose(-2, -1), offs=offsets)
        (out * g).sum().backward()
        return weight.grad.clone()

    stats = []
    exact = grad("L0")
    grad("L3", stats.append)
    assert stats[0].by_kind["matmul"] > 0 and stats[0].exact == {}, stats[0].exact
    assert stats[0].saved_bytes / stats[0].kept_bytes > 10
    eight = grad(level(8))
    assert ((eight - exact).norm() / exact.norm()).item() < 0.02
    samples = torch.stack([grad(level(2)) for _ in range(64)])
    assert shrinks_like_noise(samples, exact, 4, 64) < 0.4  # ~0.25 unbiased, ~1 biased


def _weight_grads(x: torch.Tensor, draws: int, level) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact weight gradient of a linear layer over ``x`` and ``draws`` rounded ones."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(x.shape[-1], 32)
    g = torch.randn((*x.shape[:-1], 32), generator=torch.Generator().manual_seed(1))

    def grad(lv):
        layer.zero_grad()
        with actune.compressed(lv):
            out = layer(x)
        (out * g).sum().backward()
        return layer.weight.grad.clone()

    return grad("L0"), torch.stack([grad(level) for _ in range(draws)])


@pytest.mark.parametrize("shape", [(256, 64), (4, 128, 64)])
def test_a_layers_input_is_grouped_by_feature_so_outlier_features_do_not_drown_the_rest(shape):
    # four features 20x larger than the others, as trained transformers have: with groups
    # along the tokens each feature keeps its own step, and the others' weight gradients keep
    # the noise they have without outliers (rows of mixed features would share the outliers'
    # range: 10x the noise)
    scale = torch.ones(64)
    scale[::16] = 20.0
    x = torch.randn(shape, generator=torch.Generator().manual_seed(2)) * scale
    exact, rounded = _weight_grads(x, 16, level(2))
    plain_exact, plain = _weight_grads(x / scale, 16, level(2))
    normal = [c for c in range(64) if c % 16]

    def noise(samples, reference):
        return ((samples - reference)[:, :, normal].norm() / reference[:, normal].norm()).item()

    assert noise(rounded, exact) < 1.3 * noise(plain, plain_exact)
    assert shrinks_like_noise(rounded, exact, 2, 16) < 0.55  # still unbiased


def test_feature_major_keeps_values_and_samples_and_puts_features_first():
    x = torch.arange(2 * 3 * 4, dtype=torch.float32).view(2, 3, 4)
    y = feature_major(x)
    assert torch.equal(y, x) and y.stride() == (12, 1, 3)  # per sample: features, then tokens
    flat = feature_major(x.view(6, 4))
    assert torch.equal(flat, x.view(6, 4)) and flat.stride() == (1, 6)
    for kept in (x.transpose(1, 2), torch.ones(5), torch.ones(7, 1), torch.ones(1, 9)):
        assert feature_major(kept) is kept  # strided, 1-D, one feature, or one row


def test_only_a_weights_input_is_grouped_by_feature(monkeypatch):
    # attention's scores and probabilities (two activations multiplied) keep row groups
    seen = []
    original = keeping.quantize_checked

    def spy(t, *args, by_feature=False, **kwargs):
        if by_feature:
            seen.append(tuple(t.shape))
        return original(t, *args, by_feature=by_feature, **kwargs)

    w = torch.nn.Parameter(torch.randn(64, 64))
    a = torch.randn(8, 64, 64).requires_grad_()
    monkeypatch.setattr(keeping, "quantize_checked", spy)
    with actune.compressed(level(2)):
        h = a * 1.0
        (h @ h.transpose(-1, -2)).sum().backward(retain_graph=True)
        assert seen == []
        (h @ w).sum().backward()
    assert seen == [(512, 64)]  # (matmul folds the batch into the rows of an mm)


def _frozen_input_grad(level, autocast: bool):
    """The input gradient through a frozen linear layer (no weight gradient), and the
    statistics of what was kept."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(256, 256).requires_grad_(False)
    x = torch.randn(64, 256, requires_grad=True)
    g = torch.randn(64, 256)
    out = {}
    with (torch.autocast("cpu", torch.bfloat16, enabled=autocast),
          actune.compressed(level, stats=lambda s: out.setdefault("stats", s))):
        y = layer(x)
    grad, = torch.autograd.grad(y, x, g.to(y.dtype))
    return grad, out.get("stats")


@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "bf16-autocast"])
def test_a_frozen_weight_is_never_rounded(autocast):
    # a LoRA model's base layers: backward reads the weight (its transpose, a view outside
    # autograd; under autocast, a bf16 copy) for the input gradient alone, which rounding the
    # weight would perturb for every layer below (a LoRA fine-tune lost 2.9% at L3)
    exact, _ = _frozen_input_grad("L0", autocast)
    grad, stats = _frozen_input_grad("u2", autocast)
    assert torch.equal(grad, exact)
    if autocast:  # a copy PyTorch keeps too: accounted as exact, under its own name
        assert stats.packed == 0
        assert stats.exact == {"linear frozen weight (autocast copy)": 256 * 256 * 2}
    else:  # the weight itself: a reference, nothing kept
        assert stats is None or stats.saved_bytes == 0


def _weight_grad_error(features_in: int, features_out: int, level, traced: bool = False):
    """The relative error of a linear layer's weight gradient at ``level`` (one draw)."""
    from actune.traced import TracedMode

    torch.manual_seed(0)
    layer = torch.nn.Linear(features_in, features_out)
    x = torch.randn(512, features_in)
    g = torch.randn(512, features_out)

    def grad(lv):
        layer.zero_grad()
        scope = TracedMode(actune.get_level(lv)) if traced and lv != "L0" \
            else actune.compressed(lv)
        with scope:
            out = layer(x * 1)
        (out * g).sum().backward()
        return layer.weight.grad.clone()

    exact = grad("L0")
    return float((grad(level) - exact).norm() / exact.norm())


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "traced"])
def test_a_widening_layers_input_keeps_the_nonlinear_width(traced):
    # an adapter's B matrix (rank 8 in, 128 out): its input costs 1/16 of its output's memory
    # and its rounding noise goes whole into the adapter's gradient
    widening = _weight_grad_error(8, 128, "u2", traced)
    plain = _weight_grad_error(64, 128, "u2", traced)
    assert widening < 0.02 < 0.2 < plain  # 8 bits against 2


def test_the_allocator_leaves_a_widening_input_at_its_width():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 8), torch.nn.Linear(8, 128))
    actune.compress(model, "L3", every=1)
    x = torch.randn(512, 64)
    for _ in range(3):
        model(x).square().mean().backward()
    ap = actune.autoprec_of(model)
    assert [s.per_sample_numel * s.samples for s in ap.slots] == [512 * 64]  # B's input: none


@pytest.mark.parametrize("layer", ["conv1d", "linear"])
def test_a_weight_computed_in_forward_is_never_rounded(layer):
    # weight norm's ``g * v / |v|`` (wav2vec2's positional convolution) is made each forward:
    # no parameter, yet the weight backward reads for the input gradient alone; rounding it
    # (at one bit, where the bit allocator priced its noise at nothing) perturbed every
    # gradient below it
    from torch.nn.utils.parametrizations import weight_norm

    torch.manual_seed(0)
    module = weight_norm(torch.nn.Conv1d(32, 32, 16, padding=8, groups=4) if layer == "conv1d"
                         else torch.nn.Linear(64, 64))
    x = torch.randn(4, 32, 64) if layer == "conv1d" else torch.randn(128, 64)

    def input_grad(level):
        found = []
        x_ = x.clone().requires_grad_()
        with actune.compressed(level, stats=found.append):
            y = module(x_ * 1.0)
        y.square().sum().backward()
        return x_.grad, found[0]

    exact, _ = input_grad("L0")
    grad, stats = input_grad("u2")
    assert torch.allclose(grad, exact, rtol=1e-5, atol=1e-6)  # the weight exact, x rounded
    assert stats.packed >= 1
    assert stats.exact == {f"{layer} weight": module.weight.numel() * 4}


@pytest.mark.parametrize("spelling", ["x @ w.T", "matmul(x, w.t())", "linear"])
def test_autocasts_copy_of_a_weights_view_stays_a_reference(spelling):
    # under autocast ``x @ w.T`` (Falcon's linear layers) saves a 16-bit copy of the view,
    # whose grad_fn passes through the view to the weight's: it was rounded as an activation
    # (Falcon's one-step L3 error under bf16: 117% against 23% in float32)
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(96, 64) / 8)
    x = torch.randn(128, 64, requires_grad=True)
    calls = {"x @ w.T": lambda a: a @ w.T, "matmul(x, w.t())": lambda a: torch.matmul(a, w.t()),
             "linear": lambda a: F.linear(a, w)}

    def grads(lv):
        found = []
        torch.manual_seed(1)
        with actune.compressed(lv, stats=found.append), torch.autocast("cpu",
                                                                        dtype=torch.bfloat16):
            y = calls[spelling](x * 1.0)
        gx, gw = torch.autograd.grad(y.float().sum(), [x, w])
        return gx, gw, found[0]

    gx0, gw0, _ = grads("L0")
    gx, gw, stats = grads("u2")
    assert torch.equal(gx, gx0)  # the input's gradient reads the weight alone: exact
    assert stats.packed == 1  # the input's copy; the weight's a reference (not in saved bytes)
    assert stats.saved_bytes == x.numel() * 2
    assert (gw - gw0).norm() / gw0.norm() > 1e-3  # (the input is rounded)
