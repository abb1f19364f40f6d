"""Train a model at several levels on real data, side by side, with the same seeds.

Each level starts from the same initial weights and sees the same batches in the same order;
only the compression differs (and the rounding's own random draws).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

import torch
from torch import nn

from actune.apps.data import Dataset
from actune.apps.precision import PRECISIONS, autocast, cast_model, scaler
from actune.autoprec.allocator import AutoPrecision
from actune.convert import autoprec_of, compress
from actune.levels import Level

__all__ = ["EpochResult", "accuracy", "default_optimizer", "train"]


@dataclass(frozen=True)
class EpochResult:
    """One epoch of one level: mean training loss, accuracies (fractions) and seconds."""

    level: str
    epoch: int
    loss: float
    train_accuracy: float
    test_accuracy: float
    seconds: float
    mean_bits: float | None = None  # the allocator's bits per element (mixed precision)

    def as_dict(self) -> dict:
        return asdict(self)


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int = 512,
             device: str | torch.device = "cpu") -> float:
    """Fraction of ``x`` classified as ``y`` (evaluation mode, no compression needed)."""
    was = model.training
    model.eval()
    right = 0
    for xb, yb in zip(x.split(batch_size), y.split(batch_size), strict=True):
        right += int((model(xb.to(device)).argmax(1) == yb.to(device)).sum())
    model.train(was)
    return right / len(y)


def train(build_model: Callable[[], nn.Module], data: Dataset, level: Level, *, epochs: int,
          seed: int, batch_size: int = 64, loss_fn: Callable = nn.functional.cross_entropy,
          make_optimizer: Callable | None = None, every: int = 50, per_sample: bool = True,
          device: str | torch.device = "cpu",
          on_step: Callable[[], None] | None = None,
          keep: Callable[[nn.Module, AutoPrecision | None], None] | None = None,
          precision: str = "32-true", compiled: bool = False,
          compile_backend: str = "inductor") -> Iterator[EpochResult]:
    """Train a fresh model (built after ``torch.manual_seed(seed)``) at ``level``; yields one
    :class:`EpochResult` per epoch. ``every``: steps between re-allocations and ``per_sample``:
    bits per sample too (mixed-precision levels; the allocator is told each batch's sample
    indices, see :meth:`AutoPrecision.samples`). ``keep`` is called with the model and its
    allocator at the end. ``precision``: Lightning's names (:mod:`actune.apps.precision`).
    ``compiled``: the model compiled in place (``model.compile()``; results named "L3
    compiled"; the first epoch's seconds include compiling, evaluation's too), with
    ``compile_backend``."""
    torch.manual_seed(seed)
    model = cast_model(precision, build_model().to(device))
    kind = torch.device(device).type
    grad_scaler = scaler(precision, kind)
    inputs_dtype = PRECISIONS[precision][1]
    compress(model, level, every=every, per_sample=per_sample)
    model.train()
    if compiled:  # (in place: actune's global module hooks fire once, not twice as they
        model.compile(backend=compile_backend)  # would around torch.compile's wrapper)
    name = f"{level.name} compiled" if compiled else level.name
    optimizer = (make_optimizer or default_optimizer)(model.parameters())
    order = torch.Generator().manual_seed(seed)
    ap = autoprec_of(model)
    for epoch in range(1, epochs + 1):
        start = time.perf_counter()
        total_loss = 0.0
        right = seen = 0
        for idx in data.batch_indices(batch_size, order):
            xb = data.x_train[idx].to(device, non_blocking=True)
            yb = data.y_train[idx].to(device, non_blocking=True)
            if ap is not None and per_sample:
                ap.samples(idx)  # which samples these are: their gradients are remembered
            if inputs_dtype is not None and xb.is_floating_point():
                xb = xb.to(inputs_dtype)
            with autocast(precision, kind):
                out = model(xb)
                loss = loss_fn(out, yb)
            optimizer.zero_grad(set_to_none=True)
            if grad_scaler is None:
                loss.backward()
                optimizer.step()
            else:
                grad_scaler.scale(loss).backward()
                grad_scaler.step(optimizer)
                grad_scaler.update()
            # summed on the device: one transfer per epoch, not per step
            total_loss = total_loss + loss.detach() * len(yb)
            right = right + (out.detach().argmax(1) == yb).sum()
            seen += len(yb)
            if on_step is not None:
                on_step()
        total_loss, right = float(total_loss), int(right)
        seconds = time.perf_counter() - start
        yield EpochResult(name, epoch, total_loss / seen, right / seen,
                          accuracy(model, data.x_test if inputs_dtype is None
                                   else data.x_test.to(inputs_dtype), data.y_test,
                                   device=device), seconds,
                          ap.mean_bits if ap is not None and ap.reallocations else None)
    if keep is not None:
        keep(model, ap)


def default_optimizer(parameters) -> torch.optim.Optimizer:
    """SGD, lr 0.01, momentum 0.9: what :func:`train` and a model file without
    ``make_optimizer`` use."""
    return torch.optim.SGD(parameters, lr=0.01, momentum=0.9)
