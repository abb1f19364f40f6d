"""The ordered convolution backward: PyTorch's gradients, one activation-sized tensor less."""

import weakref

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import actune
from actune import tunables
from actune.memory import StepMeter
from actune.packing import saved
from actune.substitutes import functions as substitutes

CASES = [  # (conv, input shape, kwargs)
    (F.conv2d, (2, 4, 9, 11), dict(out=6, k=3, stride=1, padding=1, dilation=1, groups=1)),
    (F.conv2d, (2, 4, 9, 11), dict(out=6, k=3, stride=2, padding=1, dilation=1, groups=2)),
    (F.conv2d, (3, 4, 10, 7), dict(out=8, k=1, stride=2, padding=0, dilation=1, groups=1)),
    (F.conv2d, (2, 4, 12, 12), dict(out=4, k=3, stride=3, padding=2, dilation=2, groups=4)),
    (F.conv1d, (2, 4, 31), dict(out=6, k=5, stride=2, padding=2, dilation=1, groups=1)),
    (F.conv3d, (2, 2, 5, 6, 7), dict(out=4, k=3, stride=2, padding=1, dilation=1, groups=1)),
]


def _grads(func, shape, kw, bias, lean, monkeypatch):
    monkeypatch.setattr(tunables, "LEAN_NUMEL", 0 if lean else 2**62)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen, dtype=torch.float64).requires_grad_()
    dims = len(shape) - 2
    w = torch.randn((kw["out"], shape[1] // kw["groups"], *[kw["k"]] * dims), generator=gen,
                    dtype=torch.float64).requires_grad_()
    b = torch.randn(kw["out"], generator=gen, dtype=torch.float64).requires_grad_() if bias \
        else None
    torch.manual_seed(1)
    with actune.compressed(actune.Level("t", matmul_bits=4, min_numel=1)):
        y = func(x, w, b, kw["stride"], kw["padding"], kw["dilation"], kw["groups"])
    assert (type(y.grad_fn).__name__ == "OrderedConvBackward") == lean
    y.mul(torch.linspace(-1, 1, y.numel(), dtype=y.dtype).reshape(y.shape)).sum().backward()
    return [t.grad for t in (x, w, b) if t is not None]


@pytest.mark.parametrize(("func", "shape", "kw"), CASES)
@pytest.mark.parametrize("bias", [False, True])
def test_ordered_conv_backward_gives_pytorchs_gradients(func, shape, kw, bias, monkeypatch):
    ordered = _grads(func, shape, kw, bias, True, monkeypatch)
    native = _grads(func, shape, kw, bias, False, monkeypatch)
    for a, b in zip(ordered, native, strict=True):  # the same rounding, the same gradients
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("lean", [True, False])
def test_channels_last_gradients_keep_pytorchs_layout(lean, monkeypatch):
    monkeypatch.setattr(tunables, "LEAN_NUMEL", 0 if lean else 2**62)
    torch.manual_seed(0)
    conv = nn.Conv2d(4, 6, 3, padding=1).double().to(memory_format=torch.channels_last)
    leaf = torch.randn(2, 4, 9, 11, dtype=torch.float64).to(
        memory_format=torch.channels_last).requires_grad_()

    def input_grad(level):  # the gradient reaching the convolution's input, as it arrives
        seen = []
        x = leaf * 1
        x.register_hook(seen.append)
        with actune.compressed(level):
            out = conv(x)
        out.sum().backward()
        return out, seen[0]

    _, expected = input_grad("L0")
    out, got = input_grad(actune.Level("t", matmul_bits=8, min_numel=1))
    assert (type(out.grad_fn).__name__ == "OrderedConvBackward") == lean
    assert out.is_contiguous(memory_format=torch.channels_last)
    assert got.stride() == expected.stride()  # channels_last, as PyTorch's own
    torch.testing.assert_close(got, expected)  # the input gradient needs no input


def test_frozen_weights_and_inputs_without_gradients(monkeypatch):
    monkeypatch.setattr(tunables, "LEAN_NUMEL", 0)
    conv = nn.Conv2d(3, 4, 3, padding=1)
    conv.weight.requires_grad_(False)
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    with actune.compressed("L3"):
        out = conv(x)
    out.sum().backward()
    assert x.grad is not None and conv.weight.grad is None and conv.bias.grad is not None
    conv.weight.requires_grad_(True)
    with actune.compressed("L3"):
        out = conv(torch.randn(2, 3, 8, 8))
    out.sum().backward()
    assert conv.weight.grad is not None


def test_double_backward_through_the_ordered_conv_raises(monkeypatch):
    monkeypatch.setattr(tunables, "LEAN_NUMEL", 0)
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    conv = nn.Conv2d(3, 4, 3)
    with actune.compressed("L3"):
        loss = conv(x).square().sum()
    with pytest.raises(actune.DoubleBackwardError):
        torch.autograd.grad(loss, x, create_graph=True)


class _TwoConvs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(3, 16, 3, padding=1, bias=False)
        self.b = nn.Conv2d(16, 16, 3, padding=1, bias=False)

    def forward(self, x):
        return self.b(self.a(x))


def _peak(model_cls, batch_shape: tuple, mode: str, threshold: int, monkeypatch) -> int:
    """Peak bytes of one u2 step of ``model_cls`` on a random batch of ``batch_shape``, the
    ordered paths taken from ``threshold`` elements."""
    monkeypatch.setattr(tunables, "LEAN_NUMEL", threshold)

    def build():
        torch.manual_seed(0)
        model = model_cls()
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    def step(model, opt, batch, _sink):
        x = torch.randn(batch, *batch_shape[1:])
        opt.zero_grad(set_to_none=True)
        with actune.compressed("u2"):
            loss = model(x).mean()
        loss.backward()
        opt.step()

    return StepMeter(build, step, mode).peak(batch_shape[0]).total


def _conv_peak(mode: str, lean: bool, monkeypatch) -> int:
    return _peak(_TwoConvs, (4, 3, 128, 128), mode, 2**20 if lean else 2**62, monkeypatch)


@pytest.mark.parametrize("mode", ["measure", "estimate"])
def test_ordered_conv_backward_frees_the_input_before_its_gradient(mode, monkeypatch):
    activation = 4 * 16 * 128 * 128 * 4  # conv b's input: 2**20 float32 elements
    saved = _conv_peak(mode, False, monkeypatch) - _conv_peak(mode, True, monkeypatch)
    assert 0.9 * activation <= saved <= 1.1 * activation


def test_the_estimate_sees_the_ordered_backward_as_measured(monkeypatch):
    measured = _conv_peak("measure", True, monkeypatch)
    assert abs(_conv_peak("estimate", True, monkeypatch) - measured) <= 0.01 * measured


# -- packed values are freed as backward moves down -------------------------------------------


def _nodes(loss, name: str = "PackedReLUBackward"):
    """The nodes of ``loss``'s graph whose type is ``name``."""
    seen, todo, found = set(), [loss.grad_fn], []
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == name:
            found.append(node)
        todo.extend(n for n, _ in node.next_functions)
    return found


def _relu_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
                         nn.ReLU(inplace=True), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(8 * 8 * 8, 4), nn.ReLU())


def test_packed_values_are_released_by_backward_not_when_the_graph_dies(monkeypatch):
    monkeypatch.setattr(tunables, "LEAN_NUMEL", 0)  # every ReLU a PackedReLU
    model, x = _relu_net(), torch.randn(4, 3, 16, 16)
    with actune.compressed("u2"):
        loss = model(x).square().sum()
    nodes = _nodes(loss)
    assert len(nodes) == 3
    packed = [weakref.ref(node.y) for node in nodes]
    loss.backward()
    assert all(ref() is None for ref in packed)  # freed while ``loss`` keeps the graph alive
    with pytest.raises(RuntimeError, match="second time"):
        loss.backward()


def _two_backwards(model, x, level):
    """Parameter gradients of two backward passes through one retained graph."""
    with actune.compressed(level):
        loss = model(x).square().sum()
    loss.backward(retain_graph=True)
    first = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    loss.backward()
    return first, [p.grad for p in model.parameters()]


def test_retain_graph_keeps_packed_values_for_a_second_backward():
    model = _relu_net()
    first, second = _two_backwards(model, torch.randn(4, 3, 16, 16), "u2")
    for a, b in zip(first, second, strict=True):
        torch.testing.assert_close(b, a)


def test_the_ordered_conv_follows_autocast(monkeypatch):
    conv = nn.Conv2d(4, 8, 3, padding=1)
    x = torch.randn(2, 4, 8, 8, requires_grad=True)
    grads = []
    for lean in (True, False):
        monkeypatch.setattr(tunables, "LEAN_NUMEL", 0 if lean else 2**62)
        conv.zero_grad()
        x.grad = None
        torch.manual_seed(0)
        with torch.autocast("cpu", dtype=torch.bfloat16), actune.compressed("u4"):
            out = conv(x)
        assert out.dtype == torch.bfloat16
        assert (type(out.grad_fn).__name__ == "OrderedConvBackward") == lean
        out.float().square().sum().backward()
        grads.append((x.grad, conv.weight.grad, conv.bias.grad))
    for a, b in zip(*grads, strict=True):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


def test_mixed_precision_statistics_steps_run_through_the_ordered_conv(monkeypatch):
    """L3's allocator (statistics steps, bits per sample) sees the ordered convolution's saved
    input like any other: training runs and its slots are allocated."""
    monkeypatch.setattr(tunables, "LEAN_NUMEL", 0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))
    actune.compress(model, "L3", every=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = torch.randn(16, 3, 12, 12), torch.randint(0, 4, (16,))
    for _ in range(5):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        assert len(_nodes(loss, "OrderedConvBackward")) == 2
        loss.backward()
        opt.step()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    ap = actune.autoprec_of(model)
    assert ap.steps == 5 and ap.reallocations >= 2


# -- derivatives: one pass of PyTorch's backward kernel, packed before the output exists -----


_DERIVATIVES = [
    (F.gelu, substitutes.gelu_derivative("none"), "gelu_backward"),
    (lambda t: F.gelu(t, approximate="tanh"), substitutes.gelu_derivative("tanh"),
     "gelu_backward"),
    (F.silu, substitutes.silu_derivative, "silu_backward"),
]


@pytest.mark.parametrize(("fn", "derivative", "kernel"), _DERIVATIVES)
def test_derivatives_are_pytorchs(fn, derivative, kernel):
    x = torch.linspace(-8, 8, 4001, dtype=torch.float64, requires_grad=True)
    fn(x).sum().backward()
    before = x.detach().clone()
    torch.testing.assert_close(derivative(x.detach(), None), x.grad, rtol=1e-12, atol=1e-12)
    assert torch.equal(x.detach(), before)  # the input is read, never written
    strided = x.detach().view(1, -1)[:, ::3]  # a view: the kernel reads it as it is
    torch.testing.assert_close(derivative(strided, None), x.grad[::3].view(1, -1))


@pytest.mark.parametrize(("fn", "derivative", "kernel"), _DERIVATIVES)
def test_a_derivative_is_one_kernel_and_one_tensor(fn, derivative, kernel):
    """No temporaries of the input's size: the one op that makes a tensor that large is the
    backward kernel (its unit gradient is a broadcast scalar)."""

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.large = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and out.untyped_storage().nbytes() >= 4096:
                self.large.append((func.__name__, out.untyped_storage().nbytes()))
            return out

    x = torch.randn(64, 512)
    with Ops() as ops:
        derivative(x, None)
    assert ops.large == [(f"{kernel}.default", x.nbytes)]


class _MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(64, 256), nn.Linear(256, 64)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


def test_gelu_backward_in_place_keeps_retain_graph_exact():
    """The derivative's dequantized copy becomes the input gradient; a retained graph
    dequantizes it again for a second backward, which gives the same gradients."""
    model, x = _MLP(), torch.randn(8, 16, 64)
    first, second = _two_backwards(model, x, "u4")
    for a, b in zip(first, second, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
    with actune.compressed("u8"), torch.random.fork_rng():
        loss = model(x).square().sum()
    model.zero_grad()
    loss.backward()
    compressed = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(x).square().sum().backward()
    for a, p in zip(compressed, model.parameters(), strict=True):  # 8 bits: close to exact
        torch.testing.assert_close(a, p.grad, rtol=0.05, atol=0.05 * p.grad.abs().max().item())


def test_a_fresh_copy_is_never_shared():
    """``fresh()`` hands out a dequantized tensor nobody else holds: a copy when another node
    holds the dequantized value, and never the stored tensor itself."""
    value = saved.Saved(actune.quantize(torch.randn(4, 256), 4), offload=False)
    with torch.no_grad():
        held = value.get()
        mine = value.fresh()
        assert mine is not held and torch.equal(mine, held)
        mine.zero_()
        assert held.abs().sum() > 0 and value.get() is held
        del held
        alone = value.fresh()
        assert value.unpacked is None  # not left for others to find
        kept = saved.Saved(torch.arange(4.0), offload=False)
        copy = kept.fresh()
        copy.zero_()
        assert torch.equal(kept.get(), torch.arange(4.0))
    assert alone.shape == (4, 256)
