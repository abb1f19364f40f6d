"""What an estimate means for a compiled step: compiled steps measured on the CPU.

The estimate traces an eager step. Under ``torch.compile`` the partitioner decides what is
saved and Inductor plans the buffers, so a compiled step's peak differs (docs/training.md,
"torch.compile"). :func:`calibrate` runs the level's compiled step at two batches on the CPU,
real tensors, beside the eager estimate at the same two: how the compiled peak grows against
how the estimate grows (their ratio), and where it starts. :func:`scaled` turns an estimate's
probe into the compiled step's by that line, so the same search answers for it.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

import actune
from actune import tunables
from actune.memory.heap import allocation_peak
from actune.tune.alternatives import Config
from actune.tune.probe import Trial, prepare
from actune.tune.search import Probe, largest_fitting
from actune.tune.workload import Workload

__all__ = ["Answer", "Calibration", "Point", "calibrate", "compiled_answer", "compiled_peak",
           "measure_point", "scaled"]


@dataclass(frozen=True)
class Point:
    """A compiled step against the eager estimate at one batch and sizes: what each holds
    beyond the parameter state (parameters, gradients, optimizer state; the estimate's)."""

    batch: int
    estimate: int
    measured: int


@dataclass(frozen=True)
class Calibration:
    """The line through two :class:`Point` s: a compiled step's peak from an estimate's."""

    low: Point
    high: Point

    @property
    def batches(self) -> tuple[int, int]:
        return self.low.batch, self.high.batch

    @property
    def ratio(self) -> float:
        """How much the compiled peak grows per byte the estimate grows."""
        rise = self.high.estimate - self.low.estimate
        return (self.high.measured - self.low.measured) / rise if rise else 1.0

    def predict(self, peak: int, fixed: int) -> int:
        """A compiled step's peak from an estimate's ``peak`` holding ``fixed`` bytes of
        parameter state (counted once: the same in both steps)."""
        return fixed + self.low.measured + round(
            self.ratio * (peak - fixed - self.low.estimate))


def _held_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    """Bytes of the parameters and the optimizer's state (each storage once)."""
    tensors = [*model.parameters(), *(v for state in opt.state.values()
                                      for v in state.values() if isinstance(v, torch.Tensor))]
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in tensors}.values())


def compiled_peak(workload: Workload, config: Config, sizes: dict, batch: int,
                  backend: str = "inductor") -> int:
    """Peak bytes of one compiled training step at ``batch`` on the CPU: parameters and
    optimizer state held before it plus the allocator-level high of the step itself
    (:func:`actune.memory.heap.allocation_peak`), after two steps (the first compiles)."""
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = prepare(workload, config, workload.model(**sizes))
        opt = workload.make_optimizer(model)
        inputs, targets = workload.make_batch(batch, sizes.get("resolution"))
    run = torch.compile(model, backend=backend, dynamic=False)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with actune.compressed(config.run_level), config.saving("cpu"):
            loss = workload.step_loss(run, inputs, targets)
        loss.backward()
        opt.step()

    with warnings.catch_warnings():  # (torch warns of actune's global module hooks)
        warnings.filterwarnings("ignore", message=r"Using `torch.compile\(module\)` when")
        for _ in range(2):
            step()
        opt.zero_grad(set_to_none=True)
        return _held_bytes(model, opt) + allocation_peak(step, quiet=True)


def measure_point(workload: Workload, config: Config, sizes: dict, batch: int,
                  backend: str = "inductor") -> Point | None:
    """A compiled step against the eager estimate (fake tensors, the CPU) at ``batch`` and
    ``sizes``; None where the estimate passes :data:`tunables.COMPILED_CPU_CAP`."""
    est = Trial(workload, config, sizes, "estimate", "cpu").peak(batch)
    if est.total > tunables.COMPILED_CPU_CAP:
        return None
    fixed = est.parameters + est.gradients + est.optimizer
    return Point(batch, est.total - fixed,
                 compiled_peak(workload, config, sizes, batch, backend) - fixed)


def calibrate(workload: Workload, config: Config, sizes: dict, batch: int,
              backend: str = "inductor", largest: int | None = None) -> Calibration:
    """The line through compiled steps at ``batch`` and at a larger batch: doubled while it
    stays within ``largest`` (the eager answer: the line is read near it) and its estimate
    within :data:`tunables.COMPILED_CPU_CAP`."""
    trial = Trial(workload, config, sizes, "estimate", "cpu")
    second = batch * 2
    while (largest is None or second * 2 <= largest) \
            and trial.peak(second * 2).total <= tunables.COMPILED_CPU_CAP:
        second *= 2
    low = measure_point(workload, config, sizes, batch, backend)
    high = measure_point(workload, config, sizes, second, backend)
    if low is None or high is None:
        raise ValueError(f"a compiled step at batch {batch} would pass the CPU's "
                         f"{tunables.COMPILED_CPU_CAP / 2**30:g} GiB: nothing to measure")
    return Calibration(low, high)


def scaled(probe: Callable[[int], Probe], calibration: Calibration,
           budget: int) -> Callable[[int], Probe]:
    """``probe`` (an estimate) as the compiled step's, by the calibration's line. A size whose
    estimate has no peak does not fit."""
    def run(n: int) -> Probe:
        p = probe(n)
        if p.peak is None or p.fixed is None:
            return Probe(n, False, None)
        peak = calibration.predict(p.peak, p.fixed)
        grows = None if p.grows is None else round(calibration.ratio * p.grows)
        return Probe(n, peak <= budget, peak, p.fixed, grows)
    return run


@dataclass(frozen=True)
class Answer:
    """The compiled step's largest size, the line it was read off, and whether a compiled
    step at that size was measured to fit (else extrapolated past
    :data:`tunables.COMPILED_CPU_CAP`)."""

    value: int | None
    calibration: Calibration
    checked: bool
    measured: tuple[int, ...] = ()  # every batch a compiled step ran at, in order


def compiled_answer(probe: Callable[[int], Probe], calibration: Calibration, budget: int,
                    check: Callable[[int], Point | None], *, start: int, step: int,
                    maximum: int | None) -> Answer:
    """The largest size whose compiled step fits ``budget``: the search of ``probe`` (an
    estimate) through :func:`scaled`, then a compiled step at the answer (``check``); where it
    does not fit, the line through the two largest measured points and the search again, at
    most :data:`tunables.COMPILED_REFINE` times. An answer past the CPU's cap is not checked."""
    cal, measured = calibration, list(calibration.batches)
    for _ in range(tunables.COMPILED_REFINE):
        value = largest_fitting(scaled(probe, cal, budget), start=start, step=step,
                                maximum=maximum, budget=budget).value
        if value is None:
            return Answer(None, cal, False, tuple(measured))
        point = check(value)
        if point is None:
            return Answer(value, cal, False, tuple(measured))
        measured.append(value)
        if point.measured + (probe(value).fixed or 0) <= budget:
            return Answer(value, cal, True, tuple(measured))
        if point.batch in cal.batches:
            break
        largest = max(cal.low, cal.high, key=lambda p: p.batch)
        cal = Calibration(*sorted((largest, point), key=lambda p: p.batch))
    return Answer(None, cal, False, tuple(measured))
