"""The numerics of compressed training: gradient bias and variance, against SGD's own noise.

For one model state and one batch, the exact gradient is computed once (nothing compressed);
the same step at a level is then repeated with ``repeats`` different rounding seeds. Per layer
(the parameters of one module) and in total:

* bias: ``|mean of the compressed gradients - exact gradient| / |exact gradient|``, next to
  the part of it that the finite number of repeats explains (``sqrt(variance / repeats)``
  relative to the exact gradient): an unbiased scheme stays at that floor;
* quantization variance: the sum over parameters of the variance across rounding seeds;
* SGD variance: the sum over parameters of the variance of the exact gradient across
  ``draws`` random minibatches of the same size, the noise SGD lives with anyway.

Dropout is switched off while measuring, so that only the rounding varies between repeats.
Mixed-precision levels are measured at the bits their allocator chose after one statistics
step on the measured batch. With bits per sample, the allocator knows each training sample's
gradient size as a training run would have remembered it (``sensitivity``; by default
measured at the model's state with one pass over the training split).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from actune.apps.data import Dataset
from actune.convert import autoprec_of, compress, decompress
from actune.levels import Level

__all__ = ["LayerNumerics", "LevelNumerics", "measure"]


@dataclass(frozen=True)
class LayerNumerics:
    """One module's parameters: size, bias and the two variances."""

    name: str
    numel: int
    bias: float
    bias_floor: float
    quant_variance: float
    sgd_variance: float


@dataclass
class LevelNumerics:
    """A level's numerics on one batch (layers and totals)."""

    level: str
    batch: int
    repeats: int
    draws: int
    bias: float
    bias_floor: float
    quant_variance: float
    sgd_variance: float
    layers: list[LayerNumerics] = field(default_factory=list)
    model_variance: float | None = None  # the allocator's own estimate (mixed precision)
    mean_bits: float | None = None

    @property
    def ratio(self) -> float:
        """Quantization variance over SGD variance (below 1: rounding is the smaller noise)."""
        return self.quant_variance / self.sgd_variance if self.sgd_variance else math.inf

    def as_dict(self) -> dict:
        out = asdict(self)
        out["ratio"] = self.ratio
        return out


def _grads(model: nn.Module, loss_fn: Callable, x: torch.Tensor, y: torch.Tensor,
           names: list[str]) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    loss_fn(model(x), y).backward()
    params = dict(model.named_parameters())
    return torch.cat([params[n].grad.detach().reshape(-1).double() for n in names])


def _layers(model: nn.Module) -> tuple[list[str], list[tuple[str, slice]]]:
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = dict(model.named_parameters())
    spans: dict[str, list[int]] = {}
    at = 0
    for n in names:
        owner = n.rsplit(".", 1)[0] if "." in n else "(model)"
        k = params[n].numel()
        span = spans.setdefault(owner, [at, at])
        span[1] = at + k
        at += k
    return names, [(o, slice(a, b)) for o, (a, b) in spans.items()]


def _no_dropout(model: nn.Module) -> None:
    for m in model.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd):
            m.p = 0.0


def sgd_variance(model: nn.Module, data: Dataset, batch: int, draws: int, seed: int,
                 loss_fn: Callable = nn.functional.cross_entropy) -> torch.Tensor:
    """Per-parameter variance of the exact gradient over ``draws`` random minibatches."""
    model = decompress(copy.deepcopy(model))
    _no_dropout(model)
    names, _ = _layers(model)
    gen = torch.Generator().manual_seed(seed)
    grads = []
    for _ in range(draws):
        idx = torch.randperm(len(data.x_train), generator=gen)[:batch]
        grads.append(_grads(model, loss_fn, data.x_train[idx], data.y_train[idx], names))
    return torch.stack(grads).var(0)


def measure(model: nn.Module, data: Dataset, levels: list[Level], *, batch: int = 64,
            repeats: int = 16, draws: int = 16, seed: int = 0, per_sample: bool = True,
            sensitivity: torch.Tensor | None = None,
            loss_fn: Callable = nn.functional.cross_entropy,
            on_progress: Callable[[str], None] | None = None) -> list[LevelNumerics]:
    """Bias and variance of the gradient at each level, for ``model`` as it is (a copy is
    used; its weights are not changed) on a batch of ``batch`` training samples.
    ``sensitivity``: per training sample, the gradient sizes a training run's allocator
    remembered (:attr:`AutoPrecision.sensitivity`), for bits per sample."""
    base = decompress(copy.deepcopy(model))
    base.train()
    _no_dropout(base)
    names, spans = _layers(base)
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randperm(len(data.x_train), generator=gen)[:batch]
    x, y = data.x_train[idx], data.y_train[idx]
    state = copy.deepcopy(base.state_dict())  # batch-norm statistics move with each step
    exact = _grads(base, loss_fn, x, y, names)
    sgd = sgd_variance(base, data, batch, draws, seed + 1, loss_fn)
    out = []
    for level in levels:
        if on_progress:
            on_progress(level.name)
        net = compress(copy.deepcopy(base), level, every=0, per_sample=per_sample)
        ap = autoprec_of(net)
        named = ap is not None and per_sample
        if named:  # learned once (a pass over the data), then shared by the other levels
            _remember(net, ap, data, batch, sensitivity, loss_fn, names)
            sensitivity = ap.sensitivity.clone()  # before this level's steps update it
            net.load_state_dict(state)
        if ap is not None:  # one statistics step on this batch, then the bits stay fixed
            torch.manual_seed(seed)
            if named:
                ap.samples(idx)
            ap.collect_next()
            _grads(net, loss_fn, x, y, names)
        samples = []
        for r in range(repeats):
            net.load_state_dict(state)
            torch.manual_seed(seed * 100_003 + r)
            if named:
                ap.samples(idx)
            samples.append(_grads(net, loss_fn, x, y, names))
        g = torch.stack(samples)
        mean, var = g.mean(0), g.var(0)
        layers = []
        for name, sl in spans:
            norm = float(exact[sl].norm()) or 1.0
            layers.append(LayerNumerics(
                name, sl.stop - sl.start, float((mean[sl] - exact[sl]).norm()) / norm,
                math.sqrt(float(var[sl].sum()) / repeats) / norm, float(var[sl].sum()),
                float(sgd[sl].sum())))
        norm = float(exact.norm()) or 1.0
        out.append(LevelNumerics(
            level.name, batch, repeats, draws, float((mean - exact).norm()) / norm,
            math.sqrt(float(var.sum()) / repeats) / norm, float(var.sum()), float(sgd.sum()),
            layers, ap.variance if ap is not None else None,
            ap.mean_bits if ap is not None else None))
    return out


def _remember(net: nn.Module, ap, data: Dataset, batch: int, sensitivity: torch.Tensor | None,
              loss_fn: Callable, names: list[str]) -> None:
    """Give the allocator each training sample's gradient size: ``sensitivity`` if known,
    else one pass over the training split at the model's state (weights unchanged)."""
    if sensitivity is not None:
        ap.sensitivity = sensitivity.detach().clone()
        return
    for ids in torch.arange(len(data.x_train)).split(batch):
        ap.samples(ids)
        _grads(net, loss_fn, data.x_train[ids], data.y_train[ids], names)
