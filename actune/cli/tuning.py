"""``actune maxbatch``, ``scale`` and ``bench``: tuning jobs with progress, JSON after each
level, and the results so far on Ctrl-C."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import (
    BarColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from actune.cli.app import Command, NothingKept, UsageError, app, console, errors, write_result
from actune.cli.options import (
    BENCH_BUILTIN_RESOLUTION,
    BenchResolution,
    BudgetOpt,
    CompileAnswer,
    CompileBackend,
    Debug,
    DeviceProfileOpt,
    HfClass,
    HfSpec,
    Jobs,
    JsonOpt,
    Levels,
    LoraOpt,
    MarginOpt,
    ModelFile,
    ModelName,
    ModeOpt,
    PlotOpt,
    PrecisionOpt,
    Quiet,
    Resolution,
    Shard,
    Tokens,
    WorldSize,
)
from actune.cli.workloads import check_backend, compile_answers, setup


def _progress(quiet: bool):
    if quiet:
        return contextlib.nullcontext(None)
    return Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                    TextColumn("{task.fields[done]}/{task.fields[levels]} levels"),
                    TimeElapsedColumn(), TextColumn("left"), TimeRemainingColumn(),
                    console=console, transient=True)


#: Trials a level's search typically takes (docs/tuning.md: 4-9): the progress bar's unit
TRIALS_PER_LEVEL = 5


class _Latest:
    """The report as of the last finished level (printed if the search is interrupted)."""

    report = None


def _callbacks(progress, levels, json_path: Path | None, latest: _Latest):
    from actune.tune.report import human_bytes

    per = TRIALS_PER_LEVEL
    task = (progress.add_task("starting", total=len(levels) * per, done=0, levels=len(levels))
            if progress else None)
    done: list[str] = []  # the levels finished
    tried: dict[str, int] = {}  # trials so far of each level under way (several run at once)

    def completed() -> int:
        return len(done) * per + sum(min(n, per - 1) for lv, n in tried.items()
                                     if lv not in done)

    def on_probe(level, p):
        if progress:
            peak = f", peak {human_bytes(p.peak)}" if p.peak else ""
            verdict = "fits" if p.fits else "does not fit"
            tried[level.name] = tried.get(level.name, 0) + 1
            progress.update(task, description=f"{level.name}: trial {tried[level.name]}, size "
                            f"{p.size:,} {verdict}{peak}", completed=completed())

    def on_level(report):
        latest.report = report
        if progress:
            done[:] = [row.level for row in report.levels]
            progress.update(task, completed=completed(), done=len(done))
        if json_path is not None:
            write_result(report, json_path)

    return on_probe, on_level


def _finish(report, quiet: bool, json_path: Path | None) -> None:
    from actune.tune.report import render

    if not quiet and report is not None:
        render(report, console)
        if json_path:
            console.print(f"JSON written to {json_path}")


def _run_job(job, level_list, quiet: bool, json_path: Path | None, **kwargs):
    """Run a tuning job with progress, JSON after each level, and the results so far
    printed on Ctrl-C (which then exits 130 through errors); print and return its report."""
    latest = _Latest()
    try:
        with _progress(quiet) as progress:
            on_probe, on_level = _callbacks(progress, level_list, json_path, latest)
            report = job(levels=level_list, on_probe=on_probe, on_level=on_level, **kwargs)
    except KeyboardInterrupt:
        if latest.report is None or not latest.report.levels:
            raise NothingKept from None
        _finish(latest.report, quiet, json_path)
        raise
    _finish(report, quiet, json_path)
    return report


@app.command(cls=Command)
def maxbatch(
    model_file: ModelFile = None,
    model: ModelName = "resnet50",
    hf: HfSpec = None,
    hf_class: HfClass = None,
    precision: PrecisionOpt = None,
    lora: LoraOpt = None,
    levels: Levels = "L0-L5",
    budget: BudgetOpt = None,
    mode: ModeOpt = None,
    device_profile: DeviceProfileOpt = None,
    margin: MarginOpt = None,
    resolution: Resolution = None,
    tokens: Tokens = None,
    multiple_of: Annotated[int, typer.Option(min=1, help="Round batches to this.")] = 1,
    max_batch: Annotated[int | None, typer.Option("--max", min=1, help="Largest batch to "
                                                  "try.", show_default=False)] = None,
    world_size: WorldSize = 1,
    shard: Shard = "fsdp",
    jobs: Jobs = None,
    compile_: CompileAnswer = False,
    compile_backend: CompileBackend = "inductor",
    plot: PlotOpt = None,
    json_path: JsonOpt = None,
    quiet: Quiet = False,
    debug: Debug = False,
) -> None:
    """Largest batch that fits the budget, per optimization level."""
    from actune.tune import run

    with errors(debug):
        if plot is not None:
            _require_matplotlib()
        workload, level_list, settings = setup(model_file, model, levels, budget, mode,
                                                world_size, shard, jobs, hf, hf_class,
                                                precision, device_profile, margin, lora)
        compile_answers(settings, compile_, compile_backend)
        sizes = _sizes(workload, resolution, tokens)
        t0 = time.perf_counter()
        report = _run_job(run.maxbatch, level_list, quiet, json_path, workload=workload,
                          settings=settings, sizes=sizes,
                          multiple_of=multiple_of, maximum=max_batch)
        if not quiet:
            console.print(f"{sum(len(r.probes) for r in report.levels)} probes in "
                          f"{time.perf_counter() - t0:.1f} s")
        _plot(plot, workload, level_list, settings, report, sizes, quiet)


@app.command(cls=Command)
def scale(
    model_file: ModelFile = None,
    dim: Annotated[str, typer.Option(help="depth, width, resolution, or tokens (seq-len) for "
                                     "a language model.")] = "depth",
    model: ModelName = "resnet152",
    hf: HfSpec = None,
    hf_class: HfClass = None,
    precision: PrecisionOpt = None,
    lora: LoraOpt = None,
    batch: Annotated[int, typer.Option(min=1, help="The batch size to hold fixed.")] = 64,
    levels: Levels = "L0-L5",
    budget: BudgetOpt = None,
    mode: ModeOpt = None,
    device_profile: DeviceProfileOpt = None,
    margin: MarginOpt = None,
    multiple_of: Annotated[int | None, typer.Option(
        min=1, help="Step of the search in units of the dimension (1/8 of the default depth "
        "or width; pixels or tokens for resolution, default 8).", show_default=False)] = None,
    max_scale: Annotated[float | None, typer.Option(
        "--max", help="Largest value to try (a multiplier, pixels or tokens; a language "
        "model's own positions at most).",
        show_default=False)] = None,
    world_size: WorldSize = 1,
    shard: Shard = "fsdp",
    jobs: Jobs = None,
    compile_: CompileAnswer = False,
    compile_backend: CompileBackend = "inductor",
    json_path: JsonOpt = None,
    quiet: Quiet = False,
    debug: Debug = False,
) -> None:
    """Largest depth, width, input resolution or sequence length that fits, per level."""
    from actune.tune import run

    with errors(debug):
        workload, level_list, settings = setup(model_file, model, levels, budget, mode,
                                                world_size, shard, jobs, hf, hf_class,
                                                precision, device_profile, margin, lora)
        compile_answers(settings, compile_, compile_backend)
        dim = workload.dim_of(dim)
        workload.require(dim)
        _run_job(run.scale, level_list, quiet, json_path, workload=workload,
                 settings=settings, dim=dim, batch=batch,
                 multiple_of=multiple_of, maximum=max_scale)


@app.command(cls=Command)
def bench(
    model_file: ModelFile = None,
    model: ModelName = "resnet18",
    hf: HfSpec = None,
    hf_class: HfClass = None,
    precision: PrecisionOpt = None,
    lora: LoraOpt = None,
    levels: Levels = "L0-L5",
    batch: Annotated[int, typer.Option(min=1, help="Batch size for every level.")] = 64,
    at_max: Annotated[bool, typer.Option("--at-max", help="Run each level at its own largest "
                                         "batch under the budget instead.")] = False,
    resolution: BenchResolution = None,
    tokens: Tokens = None,
    steps: Annotated[int, typer.Option(min=1, help="Timed steps per level.")] = 5,
    warmup: Annotated[int, typer.Option(min=0, help="Untimed steps first.")] = 2,
    compile_: Annotated[bool, typer.Option(
        "--compile", help="Also each level's step under torch.compile, timed in the same "
        "rounds (speed only; compiling happens in the warm-up steps).")] = False,
    compile_backend: CompileBackend = "inductor",
    budget: BudgetOpt = None,
    mode: ModeOpt = None,
    device_profile: DeviceProfileOpt = None,
    margin: MarginOpt = None,
    plot: PlotOpt = None,
    json_path: JsonOpt = None,
    quiet: Quiet = False,
    debug: Debug = False,
) -> None:
    """Throughput and memory per optimization level, side by side (real training steps)."""
    from actune.tune import bench as bench_job

    with errors(debug):
        if plot is not None:
            _require_matplotlib()
        if compile_ and at_max:
            raise UsageError("--compile times every level at one batch: drop --at-max")
        check_backend(compile_backend)
        workload, level_list, settings = setup(model_file, model, levels, budget, mode, hf=hf,
                                                hf_class=hf_class, precision=precision,
                                                device_profile=device_profile, margin=margin,
                                                lora=lora)
        if resolution is None and tokens is None and model_file is None and hf is None:
            resolution = BENCH_BUILTIN_RESOLUTION
        sizes = _sizes(workload, resolution, tokens) if "resolution" in workload.dims else {}
        report = _run_job(bench_job.bench, level_list, quiet, json_path, workload=workload,
                          settings=settings, batch=batch, at_max=at_max,
                          sizes=sizes, steps=steps, warmup=max(warmup, 1 if compile_ else 0),
                          answer=True, compile=compile_, compile_backend=compile_backend)
        _plot(plot, workload, level_list, settings, report, sizes, quiet)


def _sizes(workload, resolution: int | None, tokens: int | None) -> dict:
    """The input size ``--resolution`` or ``--tokens`` asks for (one of them; tokens only for a
    model that takes them)."""
    if resolution and tokens:
        raise UsageError("give --resolution or --tokens, not both (--tokens is a language "
                         "model's resolution)")
    if tokens:
        workload.dim_of("tokens")  # (raises for an image model)
    size = tokens or resolution
    return {"resolution": size} if size else {}


def _plot(plot: Path | None, workload, level_list, settings, report, sizes: dict,
          quiet: bool) -> None:
    """``--plot``: samples/s of real steps against batch size, each level up to its row's
    batch (its own max batch after maxbatch or bench --at-max)."""
    if plot is None:
        return
    from actune.cli.plot import throughput_curves

    throughput_curves(workload, level_list, settings, report, sizes, plot)
    if not quiet:
        console.print(f"plot written to {plot}")


def _require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install 'actune[plot]'") from None
