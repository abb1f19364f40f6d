"""The bench job: throughput and memory per level, real training steps timed side by side.

Levels at one batch are timed in interleaved rounds (one step of each per round), so drift in
the machine's speed falls on all alike; a level at its own largest batch, or one that empties
the CUDA allocator's cache, is timed alone.
"""

from __future__ import annotations

import statistics
import time
import warnings
from collections.abc import Callable

import torch

import actune
from actune.apps.precision import scaler as precision_scaler
from actune.tune.alternatives import Config, get_config
from actune.tune.probe import Trial, prepare
from actune.tune.report import LevelResult, Report
from actune.tune.run import (
    Settings,
    add_row,
    choose_blocks,
    fill_peak,
    level_note,
    maxbatch,
    new_row,
    probe_dicts,
    probe_reporter,
)
from actune.tune.search import largest_fitting
from actune.tune.selective import describe_whole
from actune.tune.workload import Workload

__all__ = ["bench", "throughput", "throughputs", "timed_rounds"]


def throughput(workload: Workload, level, batch: int, sizes: dict, device: str,
               steps: int = 5, warmup: int = 2) -> float:
    """Samples per second of real training steps: the median over ``steps`` timed steps
    after ``warmup`` untimed ones."""
    return throughputs(workload, [(level, batch)], sizes, device, steps, warmup)[0]


def throughputs(workload: Workload, runs: list[tuple], sizes: dict, device: str,
                steps: int = 5, warmup: int = 2) -> list[float]:
    """Samples per second of each (level, batch): the batch over the median of its step
    times (:func:`timed_rounds`)."""
    times = timed_rounds(workload, runs, sizes, device, steps, warmup)
    return [batch / statistics.median(t) for (_, batch), t in zip(runs, times, strict=True)]


def timed_rounds(workload: Workload, runs: list[tuple], sizes: dict, device: str,
                 steps: int = 5, warmup: int = 2,
                 backend: str = "inductor") -> list[list[float]]:
    """Step times of each (level, batch[, compiled]), one list per run: every run gets its own
    model (same seed; under ``torch.compile`` where ``compiled`` is true) and ``warmup``
    untimed steps, then the timed steps are taken in rounds, one
    step of each run per round, so drift in the machine's speed (other work, a warming
    allocator) falls on all runs alike."""
    cuda = device.startswith("cuda")

    def sync() -> None:
        if cuda:  # pragma: no cover - needs a GPU
            torch.cuda.synchronize(device)

    states = []
    for level, batch, *compiled in runs:
        torch.manual_seed(0)
        with torch.device(device):
            model = prepare(workload, get_config(level), workload.model(**sizes))
            opt = workload.make_optimizer(model)
            inputs, targets = workload.make_batch(batch, sizes.get("resolution"))
        if compiled and compiled[0]:  # (its first steps, the warm-up, compile it)
            model = torch.compile(model, backend=backend)
        states.append((get_config(level), model, opt, inputs, targets))

    scaler = precision_scaler(workload.precision, device.split(":")[0])

    def step(config, model, opt, inputs, targets) -> float:
        sync()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with actune.compressed(config.run_level), config.saving(device):
            loss = workload.step_loss(model, inputs, targets)
        if scaler is None:
            loss.backward()
            opt.step()
        else:  # 16-mixed: as Lightning's precision plugin steps
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        sync()
        return time.perf_counter() - t0

    with warnings.catch_warnings():  # (torch warns of the fusing module hooks once compiled)
        warnings.filterwarnings("ignore", message=r"Using `torch.compile\(module\)` when")
        for state in states:
            for _ in range(warmup):
                step(*state)
        times: list[list[float]] = [[] for _ in states]
        for _ in range(steps):
            for i, state in enumerate(states):
                times[i].append(step(*state))
    return times


def _round_ratios(base: list[float], times: list[float]) -> tuple[float, float, float]:
    """The per-round speed ratios (``base``'s step time over this run's, one pair per round):
    their median (the "vs L0" figure) and the middle half around it, both ends under four
    rounds (the run's own spread of that figure)."""
    ratios = sorted(b / t for b, t in zip(base, times, strict=True))
    middle = statistics.median(ratios)
    if len(ratios) < 4:
        return ratios[0], middle, ratios[-1]
    q = statistics.quantiles(ratios, n=4, method="inclusive")
    return q[0], middle, q[2]


def bench(workload: Workload, levels: list, settings: Settings, *, batch: int | None,
          at_max: bool = False, sizes: dict | None = None, steps: int = 5, warmup: int = 2,
          multiple_of: int = 1, answer: bool = False, on_probe: Callable | None = None,
          on_level: Callable[[Report], None] | None = None, compile: bool = False,
          compile_backend: str = "inductor") -> Report:
    """Throughput and memory per level at one batch (or each level's own max batch). With
    ``answer`` (an estimate, one batch for all): also the largest batch at L0 and at L3 under
    the budget, estimated (``report.answer``). With ``compile`` (one batch for all): each
    level's step under ``torch.compile`` too, timed in the same rounds (speed only)."""
    sizes = sizes or {}
    report = Report("bench", workload.name, settings.device_name, settings.budget.bytes,
                    settings.budget.source, settings.mode, "batch", dict(sizes),
                    precision=workload.precision, **settings.report_fields)
    if batch and levels:  # one untimed step first: thread pools, allocator and kernels warm up
        throughput(workload, levels[-1], batch, sizes, settings.device, steps=1, warmup=1)
    levels = [get_config(lv) for lv in levels]
    pending: list[tuple[LevelResult, Config]] = []
    for level in levels:
        trial = Trial(workload, level, sizes, settings.mode, settings.device, settings.round_to)
        used = batch
        probes: list[dict] = []
        if at_max:
            found = largest_fitting(lambda n, t=trial: t.probe(n, settings.budget.bytes),
                                    start=8, step=multiple_of,
                                    budget=settings.search_budget,
                                    on_probe=probe_reporter(on_probe, level))
            used, probes = found.value, probe_dicts(found.probes)
        level, blocks = choose_blocks(workload, level, settings, used,
                                       lambda value: (sizes, value))
        if level.whole:  # (the configuration timed: the blocks maxbatch would choose there)
            trial = Trial(workload, level, sizes, settings.mode, settings.device,
                          settings.round_to)
            if at_max:  # its own largest batch, from the one found with every block
                found = largest_fitting(lambda n, t=trial: t.probe(n, settings.budget.bytes),
                                        start=used, step=multiple_of,
                                        budget=settings.search_budget,
                                        on_probe=probe_reporter(on_probe, level))
                used, probes = found.value, probes + probe_dicts(found.probes)
        row = new_row(level, used, probes=probes,
                   note="; ".join(n for n in (
                       level_note(level, settings, real_steps=True),
                       describe_whole(level.whole, blocks) if level.whole and blocks else "")
                       if n))
        if used:
            fill_peak(row, trial.peak(used), level)
        # each level at the edge of the budget, or one that empties the CUDA allocator's cache
        # after its forward pass (which would slow whichever level runs next): timed alone
        alone = at_max or (level.level.defrag and settings.device.startswith("cuda"))
        if used and alone:
            row.samples_per_s = throughput(workload, level, used, sizes, settings.device,
                                           steps, warmup)
        if alone or not used:
            add_row(report, row, on_level)
        else:
            pending.append((row, level))
    if pending:  # one batch for all: their steps are timed in interleaved rounds
        if compile:
            pending += [(LevelResult(f"{row.level} compiled", row.value, compiled=True,
                                     base_level=row.base_level,
                                     note="torch.compile: speed only (docs/training.md)"),
                         level) for row, level in pending]
        times = timed_rounds(workload, [(level, row.value, True) if row.compiled
                                        else (level, row.value) for row, level in pending], sizes,
                             settings.device, steps, warmup, compile_backend)
        base = next((t for (row, _), t in zip(pending, times, strict=True)
                     if row.level == "L0"), None)
        for (row, _), t in zip(pending, times, strict=True):
            row.samples_per_s = row.value / statistics.median(t)
            if base is not None and row.level != "L0":
                low, row.round_ratio, high = _round_ratios(base, t)
                row.ratio_spread = [low, high]
            add_row(report, row, on_level)
        order = {lv.name: i for i, lv in enumerate(levels)}
        order.update({f"{name} compiled": i + len(order) for name, i in list(order.items())})
        if [r.level for r in report.levels] != sorted(order, key=order.get):
            report.levels.sort(key=lambda r: order[r.level])  # back in the order asked for
            if on_level:
                on_level(report)
    if at_max:  # each level at its own max batch: name the fastest
        report.choose_best()
        if on_level:
            on_level(report)
    elif answer and settings.mode == "estimate":
        started = time.perf_counter()
        found = maxbatch(workload, ["L0", "L3"], settings, sizes=sizes, multiple_of=multiple_of)
        report.answer = {**{r.level: r.value for r in found.levels},
                         "seconds": time.perf_counter() - started}
        if on_level:
            on_level(report)
    return report
