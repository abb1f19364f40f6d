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
from actune.memory.heap import allocation_peak
from actune.tune.alternatives import Config
from actune.tune.probe import Trial, prepare
from actune.tune.search import Probe, largest_fitting
from actune.tune.workload import Workload

__all__ = ["Calibration", "calibrate", "compiled_answer", "compiled_peak", "scaled"]

#: The larger calibration batch grows until the estimate grows this much between the two
#: (constant buffers then weigh little in the ratio), or the CPU step would pass the cap.
GROWTH = 16 * 2**20
CPU_CAP = 2 * 2**30


@dataclass(frozen=True)
class Calibration:
    """Compiled steps against the eager estimate at two batches, same sizes: ``batches``,
    the estimate's peaks and the compiled steps' peaks there (bytes), and the estimate's
    parameter state (parameters, gradients, optimizer state) at those sizes."""

    batches: tuple[int, int]
    estimate: tuple[int, int]
    measured: tuple[int, int]
    fixed: int

    @property
    def ratio(self) -> float:
        """How much the compiled peak grows per byte the estimate grows."""
        return (self.measured[1] - self.measured[0]) / max(1, self.estimate[1] - self.estimate[0])

    def predict(self, peak: int, fixed: int) -> int:
        """A compiled step's peak, from an estimate's ``peak`` holding ``fixed`` bytes of
        parameter state: the compiled peak at the first batch, plus ``ratio`` times how far
        the estimate is from its own there, the parameter state's change counted once
        (it is the same in both steps: a scale search's deeper or wider model)."""
        more = fixed - self.fixed
        return self.measured[0] + round(self.ratio * (peak - self.estimate[0] - more)) + more


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
        opt = workload.optimizer(model.parameters())
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


def calibrate(workload: Workload, config: Config, sizes: dict, batch: int,
              backend: str = "inductor", largest: int | None = None) -> Calibration:
    """Compiled steps against the eager estimate (fake tensors, the CPU) at ``sizes``, at
    ``batch`` and at a larger batch (doubled until the estimate grows by :data:`GROWTH`,
    within :data:`CPU_CAP` and ``largest``)."""
    trial = Trial(workload, config, sizes, "estimate", "cpu")
    first = trial.peak(batch)  # (its parameter state counted as a probe counts it)
    second = batch * 2
    while (largest is None or second * 2 <= largest) \
            and trial.peak(second).total - first.total < GROWTH \
            and trial.peak(second * 2).total <= CPU_CAP:
        second *= 2
    est = (first.total, trial.peak(second).total)
    measured = tuple(compiled_peak(workload, config, sizes, b, backend) for b in (batch, second))
    return Calibration((batch, second), est, measured,
                       first.parameters + first.gradients + first.optimizer)


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


def compiled_answer(probe: Callable[[int], Probe], calibration: Calibration, budget: int, *,
                    start: int, step: int, maximum: int | None) -> int | None:
    """The largest size whose compiled step fits ``budget``: the search of ``probe`` (an
    estimate) through :func:`scaled`."""
    return largest_fitting(scaled(probe, calibration, budget), start=start, step=step,
                           maximum=maximum, budget=budget).value
