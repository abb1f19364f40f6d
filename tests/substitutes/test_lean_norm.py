"""Batch norm's lean forward and backward, the graph that allows overwriting, and the
tracker's accounting of autograd's in-place gradient sums."""

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

import actune
from actune import tunables
from actune.apps import zoo
from actune.memory import StepMeter
from actune.memory.tracker import PeakTracker
from actune.session.hooks import allow_overwrite

LEVEL = actune.Level("t", matmul_bits=4, other_bits=4, min_numel=1)
MiB = 2**20


def _norm_grads(shape, affine, overwrite, lean, monkeypatch):
    monkeypatch.setattr(tunables, "LEAN_NUMEL", 0 if lean else 2**62)
    gen = torch.Generator().manual_seed(0)
    leaf = torch.randn(shape, generator=gen, dtype=torch.float64).mul_(3).add_(1)
    leaf.requires_grad_()
    bn = nn.BatchNorm1d(shape[1]) if len(shape) < 4 else nn.BatchNorm2d(shape[1])
    bn = bn.double()
    if affine:
        with torch.no_grad():
            bn.weight.uniform_(0.5, 2, generator=gen)
            bn.bias.uniform_(-1, 1, generator=gen)
    else:
        bn.weight = bn.bias = None
    torch.manual_seed(1)
    with actune.compressed(LEVEL):
        x = leaf * 1  # not a leaf: a batch norm may overwrite it
        if overwrite:
            allow_overwrite(x)
        y = bn(x)
    assert (type(y.grad_fn).__name__ == "LeanBatchNormBackward") == lean
    assert (y is x) == (lean and overwrite)
    y.mul(torch.linspace(-1, 1, y.numel(), dtype=y.dtype).reshape(y.shape)).sum().backward()
    weights = [bn.weight.grad, bn.bias.grad] if affine else []
    return [leaf.grad, *weights, bn.running_mean, bn.running_var]


@pytest.mark.parametrize("shape", [(6, 5, 7, 3), (8, 4), (5, 3, 9)])
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("overwrite", [True, False])
def test_lean_batch_norm_gives_pytorchs_gradients(shape, affine, overwrite, monkeypatch):
    lean = _norm_grads(shape, affine, overwrite, True, monkeypatch)
    native = _norm_grads(shape, affine, overwrite, False, monkeypatch)
    for a, b in zip(lean, native, strict=True):  # the same rounding, the same gradients
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_lean_batch_norm_keeps_float32_accuracy_far_from_zero(monkeypatch):
    """Inputs whose mean is 10,000 standard deviations away: the channel sums are taken around
    the mean, not recovered from sum(grad * x) by a cancelling subtraction."""
    grads = []
    for lean in (True, False):
        monkeypatch.setattr(tunables, "LEAN_NUMEL", 0 if lean else 2**62)
        gen = torch.Generator().manual_seed(0)
        leaf = (torch.randn(8, 4, 16, 16, generator=gen) + 1e4).requires_grad_()
        bn = nn.BatchNorm2d(4)
        torch.manual_seed(1)
        with actune.compressed(LEVEL.with_(other_bits=8)):
            y = bn(leaf * 1)
        y.backward(torch.randn(y.shape, generator=gen))
        grads.append((leaf.grad, bn.weight.grad))
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * b.abs().max().item())


def test_an_input_is_overwritten_once_and_never_outside_training(monkeypatch):
    monkeypatch.setattr(tunables, "LEAN_NUMEL", 0)
    bn = nn.BatchNorm2d(3)
    leaf = torch.randn(4, 3, 5, 5, requires_grad=True)
    with actune.compressed(LEVEL):
        x = allow_overwrite(leaf * 1)
        y = bn(x)
        z = bn(y)  # the permission was used up by the first norm
        assert y is x and z is not y
        bn.eval()
        x = allow_overwrite(leaf * 1)
        assert bn(x) is not x  # evaluation mode: PyTorch's own batch norm
    z.sum().backward()
    assert torch.isfinite(leaf.grad).all()


class _Shortcut(nn.Module):
    """A convolution whose output a batch norm reads and the block's sum reads again."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 3, 3, padding=1), nn.BatchNorm2d(3)
        self.conv2, self.bn2 = nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3)

    def forward(self, x):
        h = self.conv(x)
        out = self.bn(h) + h  # h has two readers: not overwritable
        return self.bn2(self.conv2(out))


class _Untraceable(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3)

    def forward(self, x):
        if x.sum() > 0:  # data-dependent control flow: torch.fx cannot trace it
            x = -x
        return self.bn(self.conv(x))


class _KeepingConv(nn.Conv2d):
    """A user's convolution that keeps its output: not a plain layer, traced through."""

    def forward(self, x):
        self.kept = super().forward(x)
        return self.kept


def test_the_graph_allows_only_norms_that_are_a_convolutions_only_reader():
    assert actune.allow_inplace_norms(_Shortcut()) == ["bn2"]
    assert actune.allow_inplace_norms(_Untraceable()) == []
    assert actune.allow_inplace_norms(nn.Sequential(_KeepingConv(3, 3, 1),
                                                    nn.BatchNorm2d(3))) == []
    converted = actune.compress(nn.Sequential(nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3)), LEVEL)
    assert actune.allow_inplace_norms(converted) == ["1"]  # compressed layers are layers too
    assert len(converted[0]._forward_hooks) == 1  # once, however often it is called
    actune.decompress(converted)
    assert not converted[0]._forward_hooks
    resnet = zoo.resnet(18, width=0.25)
    names = actune.allow_inplace_norms(resnet)
    assert "bn1" in names and "layer1.0.bn2" in names and "layer2.0.downsample.1" in names
    assert len(names) == sum(isinstance(m, nn.BatchNorm2d) for m in resnet.modules())


@pytest.mark.parametrize("model", [_Shortcut, _Untraceable])
def test_compress_overwrites_where_the_graph_allows_and_gradients_stay(model, monkeypatch):
    monkeypatch.setattr(tunables, "LEAN_NUMEL", 0)
    x = torch.randn(4, 3, 6, 6)

    def grads(inplace):
        torch.manual_seed(0)
        net = actune.compress(model().double(), LEVEL, inplace=inplace)
        torch.manual_seed(1)
        net(x.double()).square().sum().backward()
        return [p.grad for p in net.parameters()]

    for a, b in zip(grads(True), grads(False), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_overwriting_lowers_the_forward_peak_by_one_activation(monkeypatch):
    monkeypatch.setattr(tunables, "LEAN_NUMEL", 0)

    class Block(nn.Module):  # the shortcut x stays alive while conv -> bn runs
        def __init__(self):
            super().__init__()
            self.conv, self.bn = nn.Conv2d(8, 8, 1, bias=False), nn.BatchNorm2d(8)

        def forward(self, x):
            out = self.conv(x)
            out = self.bn(out)
            out += x
            return out

    def peak(inplace):
        def build():
            model = Block()
            if inplace:
                actune.allow_inplace_norms(model)
            return model, torch.optim.SGD(model.parameters(), lr=0.1)

        def step(model, opt, batch, sink):  # forward only: its peak is the one at stake
            x = torch.randn(batch, 8, 32, 32, requires_grad=True)
            with actune.compressed(LEVEL, stats=sink):
                model(x).sum()

        return StepMeter(build, step, "estimate").peak(64)

    activation = 64 * 8 * 32 * 32 * 4
    plain, lean = peak(False), peak(True)
    assert plain.where.startswith("forward")
    # one activation less, but for the statistics' eighth-of-the-batch temporary
    assert plain.total - lean.total == pytest.approx(activation * 7 / 8, rel=0.02)


def _tracked_peak(backward_sum_in_python: bool) -> tuple[float, str]:
    x = torch.randn(1024, 1024, requires_grad=True)  # 4 MiB
    tracker = PeakTracker()

    class Twice(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            return a * 1.0

        @staticmethod
        def backward(ctx, g):
            return g * 2.0 + g * 3.0  # a sum PyTorch allocates in any run

    with tracker:
        h = x * 1.0
        # without a Python sum: two gradients of h, which autograd sums in place in a plain run
        z = Twice.apply(h).sum() if backward_sum_in_python else (
            (h * 2.0).sum() + (h * 3.0).sum())
        del h
        z.backward()
    snap = tracker.get_tracker_snapshot("peak")
    (dev,) = snap
    return snap[dev]["Total"] / MiB, tracker.where[dev]


def test_autograds_gradient_sums_count_as_in_place():
    total, _ = _tracked_peak(False)
    assert round(total) == 8  # h and one product in forward; two gradients in backward
    total, where = _tracked_peak(True)
    assert round(total) == 12 and where.startswith("backward")  # two products and their sum


def test_relu_backward_is_written_over_its_dequantized_output():
    torch.manual_seed(0)
    leaf = torch.randn(64, 64, requires_grad=True)
    with actune.compressed(LEVEL.with_(other_bits=8, matmul_bits=8)):
        y = F.relu(leaf * 1)
    grad = torch.randn_like(y)
    y.backward(grad)
    torch.testing.assert_close(leaf.grad, torch.where(leaf > 0, grad, 0.0))
