"""The ``actune`` command line: parses arguments and renders results; the work is elsewhere."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import platform
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table


class _FlagsWithoutType:
    """Help without a ``<bool>`` type beside flags (typer shows one for flags, ``--help``
    included, though they take no value)."""

    def get_params(self, ctx):
        params = super().get_params(ctx)
        for param in params:
            if getattr(param, "is_flag", False) and param.metavar is None:
                param.metavar = ""
        return params


class _Group(_FlagsWithoutType, typer.core.TyperGroup):
    pass


class _Command(_FlagsWithoutType, typer.core.TyperCommand):
    pass


app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  cls=_Group, help="Compress saved activations to 2 bits and tune what fits "
                  "in memory.")
console = Console()
err_console = Console(stderr=True)


def _version(show: bool) -> None:
    if show:
        from actune import __version__

        console.print(f"actune {__version__}")
        raise typer.Exit()


@app.callback()
def _main(version: Annotated[bool, typer.Option(
        "--version", callback=_version, is_eager=True, help="Print the version and exit.")]
        = False) -> None:
    """Compress saved activations to 2 bits and tune what fits in memory."""


ModelFile = Annotated[Path | None, typer.Argument(
    help="A model file (build_model, make_batch; see docs/tuning.md). Default: --model.",
    show_default=False)]
ModelName = Annotated[str, typer.Option("--model", "-m", help="A built-in model, used when no "
                                        "model file is given.")]
HfSpec = Annotated[str | None, typer.Option(
    "--hf", help="A Hugging Face model from its config alone: a directory holding config.json, "
    "a config.json, or a hub ID (random weights; nothing else downloaded).",
    show_default=False)]
HfClass = Annotated[str | None, typer.Option(
    "--hf-class", help="With --hf: the model class (default: the config's architectures).",
    show_default=False)]
PrecisionOpt = Annotated[str | None, typer.Option(
    "--precision", help="How the step runs, with Lightning's names: 32-true, bf16-mixed, "
    "16-mixed (autocast; a GradScaler in real steps) or bf16-true (the model cast). Default: "
    "the model file's `precision`, else 32-true.", show_default=False)]
Levels = Annotated[str, typer.Option(help="Levels: L0-L5, L0,L3 or L3; with the alternatives "
                                     "ckpt, offload and L3+ckpt (docs/tuning.md).")]
BudgetOpt = Annotated[str | None, typer.Option(
    "--budget", "-b", help="Memory budget: 16GiB, 1500MB or 80%. Default: the GPU's free "
    "memory less a reserve; without a GPU a simulated 16 GiB device.", show_default=False)]
WorldSize = Annotated[int, typer.Option(
    min=1, help="Ranks of a data-parallel run: the peak and the answer per rank (estimate "
    "mode).")]
Shard = Annotated[str, typer.Option(help="With --world-size: fsdp (FSDP2 per block: parameters, "
                                    "gradients and optimizer state sharded) or ddp.")]
ModeOpt = Annotated[str | None, typer.Option(
    help="estimate (fake tensors, no arithmetic; the default without a GPU) or measure.",
    show_default=False)]
DeviceProfileOpt = Annotated[str | None, typer.Option(
    "--device-profile", help="Estimate for this GPU kind without it (h100, h200, a100-80, "
    "l4, ...; `actune info` lists them): its memory, CUDA's workspaces and the caching "
    "allocator's rules. Default: the GPU found, if any.", show_default=False)]
CompileBackend = Annotated[str, typer.Option(
    "--compile-backend", help="torch.compile's backend with --compile (inductor; aot_eager "
    "compiles fast, for checking a set-up).")]
CompileAnswer = Annotated[bool, typer.Option(
    "--compile", help="Also answer for a step under torch.compile: one compiled step per "
    "level measured on the CPU at a small batch, its peak related to the estimate's there "
    "and the search run again with that ratio (docs/tuning.md).")]
MarginOpt = Annotated[float | None, typer.Option(
    "--margin", min=0, max=50, help="Percent of the budget kept free. Default: 5 in "
    "estimates for a GPU, 0 otherwise.", show_default=False)]


def _output_file(example: str):
    """A typer callback for an option naming a file to write: rejected before any work starts
    if it is a folder, or if its folder cannot be made or written in."""

    def check(path: Path | None) -> Path | None:
        if path is None:
            return None
        if path.is_dir():
            raise typer.BadParameter(f"{path} is a folder; give a file in it, such as "
                                     f"{path / example}")
        existing = next(p for p in (path.parent.absolute(), *path.parent.absolute().parents)
                        if p.exists())
        if not existing.is_dir():
            raise typer.BadParameter(f"{existing} is a file, so {path} cannot be made")
        if not os.access(existing, os.W_OK | os.X_OK):
            raise typer.BadParameter(f"cannot write in {existing} (permission denied)")
        return path

    return check


JsonOpt = Annotated[Path | None, typer.Option(
    "--json", help="Also write the result as JSON (schema actune.result/2) to this path, "
    "atomically, after every finished level.", show_default=False,
    callback=_output_file("result.json"))]
Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="No progress and no table "
                                     "(use with --json).")]
Debug = Annotated[bool, typer.Option("--debug", help="Show tracebacks.")]
PerSample = Annotated[bool, typer.Option("--per-sample/--per-tensor", help="Mixed-precision "
                                         "levels (L3-L5, 2b...) choose bits per sample too, or "
                                         "only per tensor.")]
PlotOpt = Annotated[Path | None, typer.Option(
    help="Draw samples/s of real training steps against batch size per level to this PNG, "
    "each level up to its own batch (needs matplotlib).", show_default=False,
    callback=_output_file("throughput.png"))]
Jobs = Annotated[int | None, typer.Option(
    "--jobs", "-j", min=1, help="Levels searched side by side in estimate mode, one process "
    "each (default: one per CPU core; 1: one after another).", show_default=False)]
Resolution = Annotated[int | None, typer.Option(min=1, help="Input resolution (images) or "
                                                "sequence length (tokens).", show_default=False)]

BenchResolution = Annotated[int | None, typer.Option(
    min=1, help="Input resolution (images) or sequence length (tokens); default 32 for the "
    "built-in models (a quick run), a model file's own default for a file.",
    show_default=False)]
#: bench's resolution for the built-in models when none is given.
BENCH_BUILTIN_RESOLUTION = 32


class _UsageError(Exception):
    """An error already phrased for the user."""


class _NothingKept(KeyboardInterrupt):
    """Ctrl-C before a tuning job finished any level."""


@contextlib.contextmanager
def _errors(debug: bool):
    """Known errors: one paragraph, exit 2 (no traceback unless --debug); Ctrl-C: exit 130."""
    from actune.tune.probe import ProbeError
    from actune.tune.workload import WorkloadError

    try:
        yield
    except KeyboardInterrupt as err:
        kept = ("no level had finished: nothing was kept" if isinstance(err, _NothingKept)
                else "results of finished levels were kept")
        err_console.print(f"[yellow]interrupted[/]: {kept}")
        raise typer.Exit(130) from None
    except (WorkloadError, ProbeError, ValueError, _UsageError) as err:
        if debug:
            raise
        err_console.print(f"[bold red]error:[/] {escape(str(err))}")  # ('[hf]' is no markup)
        raise typer.Exit(2) from None


def _workload(model_file: Path | None, model: str, hf: str | None = None,
              hf_class: str | None = None, precision: str | None = None):
    """The workload (see :func:`_source`) at ``precision`` if given."""
    work = _source(model_file, model, hf, hf_class)
    if precision is not None:
        from actune.tune.workload import check_precision

        work.precision = check_precision(precision)
    return work


def _source(model_file: Path | None, model: str, hf: str | None = None,
            hf_class: str | None = None):
    """The model file's workload, the Hugging Face config's (``--hf``), or the built-in
    model's."""
    from actune.tune import workload as wl

    if hf is not None:
        if model_file is not None:
            raise _UsageError("give a model file or --hf, not both")
        from actune.tune.hf_workload import hf_workload

        return hf_workload(hf, hf_class)
    if hf_class is not None:
        raise _UsageError("--hf-class names the class of an --hf model: give --hf too")
    return wl.load(model_file) if model_file is not None else wl.builtin(model)


def _data(work, resolution: int | None):
    """The workload's dataset and the model sizes that go with ``resolution``."""
    try:
        data = work.dataset(resolution)
    except ImportError as err:  # scikit-learn, for the built-in digits
        raise _UsageError(str(err)) from None
    return data, ({"resolution": resolution} if resolution and "resolution" in work.dims
                  else {})


def _setup(model_file: Path | None, model: str, levels: str, budget: str | None,
           mode: str | None, world_size: int = 1, shard: str = "fsdp",
           jobs: int | None = None, hf: str | None = None, hf_class: str | None = None,
           precision: str | None = None, device_profile: str | None = None,
           margin: float | None = None):
    import torch

    from actune.memory import DeviceInfo, parse_budget, probe
    from actune.tune.alternatives import parse_configs
    from actune.tune.run import Settings

    workload = _workload(model_file, model, hf, hf_class, precision)
    level_list = parse_configs(levels)
    info = probe()
    cuda = info.available and torch.cuda.is_available()
    mode = mode or ("estimate" if device_profile or not cuda else "measure")
    if mode not in ("estimate", "measure"):
        raise _UsageError(f"--mode must be estimate or measure, not {mode!r}")
    if device_profile and mode != "estimate":
        raise _UsageError(f"--device-profile {device_profile} estimates for a GPU kind: use "
                          f"--mode estimate (or leave --mode out)")
    from actune.tune.sharding import Sharding

    sharding = Sharding(shard, world_size) if world_size > 1 else None
    if sharding is not None and mode != "estimate":
        raise _UsageError(f"--world-size {world_size} gives per-rank estimates: use --mode "
                          f"estimate (or leave --mode out without a GPU)")
    gpu = _gpu_model(device_profile, info if cuda else None) if mode == "estimate" else None
    found = DeviceInfo(False) if device_profile else info  # (a profile: not the GPU here)
    the_budget = parse_budget(budget, found, gpu.profile if gpu else None, world_size)
    margin = (5.0 if gpu else 0.0) if margin is None else margin
    if margin:
        the_budget = dataclasses.replace(
            the_budget, bytes=int(the_budget.bytes * (1 - margin / 100)),
            source=f"{the_budget.source}, less a {margin:g}% margin")
    if gpu is not None:  # the allocator may reserve up to the budget, then frees its cache
        gpu = dataclasses.replace(gpu, capacity=the_budget.bytes)
    name = (f"{gpu.profile.title} (profile {gpu.profile.name})" if device_profile else
            info.name if cuda else f"CPU ({platform.machine()})")
    settings = Settings(the_budget, mode, "cuda" if cuda else "cpu", name, sharding, jobs,
                        gpu, margin / 100)
    workload.check()
    return workload, level_list, settings


def _compile_answers(settings, on: bool, backend: str) -> None:
    """maxbatch / scale --compile: the backend the compiled answers use (checked first)."""
    if on:
        _check_backend(backend)
        if settings.sharding is not None:
            raise _UsageError("--compile measures one process's compiled step: drop "
                              "--world-size")
        settings.compile_backend = backend


def _check_backend(name: str) -> None:
    """A torch.compile backend this torch has, or one paragraph naming those it has."""
    import torch._dynamo

    known = {*torch._dynamo.list_backends(), "eager", "aot_eager"}
    if name not in torch._dynamo.list_backends(exclude_tags=()):
        raise _UsageError(f"--compile-backend {name!r} is not a torch.compile backend here; "
                          f"choose one of {', '.join(sorted(known))}")


def _gpu_model(name: str | None, found):
    """The GPU model an estimate predicts with: the profile named, else the GPU found (its
    profile, or one made from what CUDA reports), else none."""
    from actune.memory.gpu_model import GpuModel
    from actune.memory.gpu_profiles import find_profile, profile_of

    if name:
        profile = find_profile(name)
    elif found is not None:
        import torch

        profile = profile_of(found.name, found.total, torch.cuda.get_device_capability())
    else:
        return None
    return GpuModel.for_profile(profile)


def _progress(quiet: bool):
    if quiet:
        return contextlib.nullcontext(None)
    return Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                    TextColumn("{task.fields[done]}/{task.fields[levels]} levels"),
                    TimeElapsedColumn(), TextColumn("left"), TimeRemainingColumn(),
                    console=console, transient=True)


#: Trials a level's search typically takes (docs/tuning.md: 4-9): the progress bar's unit
TRIALS_PER_LEVEL = 5


def _write_json(data, path: Path) -> None:
    """Write ``--json``; a write that fails (a full disk) is the user's error to fix, exit 2."""
    from actune.report import write_json

    try:
        write_json(data, path)
    except OSError as err:
        raise _UsageError(f"cannot write --json {path}: {err.strerror or err}") from None


class _Latest:
    """The report as of the last finished level (printed if the search is interrupted)."""

    report = None


def _callbacks(progress, levels, json_path: Path | None, latest: _Latest):
    from actune.report import human_bytes

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
            _write_json(report, json_path)

    return on_probe, on_level


def _finish(report, quiet: bool, json_path: Path | None) -> None:
    from actune.report import render

    if not quiet and report is not None:
        render(report, console)
        if json_path:
            console.print(f"JSON written to {json_path}")


def _run_job(job, level_list, quiet: bool, json_path: Path | None, **kwargs):
    """Run a tuning job with progress, JSON after each level, and the results so far
    printed on Ctrl-C (which then exits 130 through _errors); print and return its report."""
    latest = _Latest()
    try:
        with _progress(quiet) as progress:
            on_probe, on_level = _callbacks(progress, level_list, json_path, latest)
            report = job(levels=level_list, on_probe=on_probe, on_level=on_level, **kwargs)
    except KeyboardInterrupt:
        if latest.report is None or not latest.report.levels:
            raise _NothingKept from None
        _finish(latest.report, quiet, json_path)
        raise
    _finish(report, quiet, json_path)
    return report


@app.command(cls=_Command)
def maxbatch(
    model_file: ModelFile = None,
    model: ModelName = "resnet50",
    hf: HfSpec = None,
    hf_class: HfClass = None,
    precision: PrecisionOpt = None,
    levels: Levels = "L0-L5",
    budget: BudgetOpt = None,
    mode: ModeOpt = None,
    device_profile: DeviceProfileOpt = None,
    margin: MarginOpt = None,
    resolution: Resolution = None,
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

    with _errors(debug):
        if plot is not None:
            _require_matplotlib()
        workload, level_list, settings = _setup(model_file, model, levels, budget, mode,
                                                world_size, shard, jobs, hf, hf_class,
                                                precision, device_profile, margin)
        _compile_answers(settings, compile_, compile_backend)
        sizes = {"resolution": resolution} if resolution else {}
        t0 = time.perf_counter()
        report = _run_job(run.maxbatch, level_list, quiet, json_path, workload=workload,
                          settings=settings, sizes=sizes,
                          multiple_of=multiple_of, maximum=max_batch)
        if not quiet:
            console.print(f"{sum(len(r.probes) for r in report.levels)} probes in "
                          f"{time.perf_counter() - t0:.1f} s")
        _plot(plot, workload, level_list, settings, report, sizes, quiet)


@app.command(cls=_Command)
def scale(
    model_file: ModelFile = None,
    dim: Annotated[str, typer.Option(help="depth, width or resolution.")] = "depth",
    model: ModelName = "resnet152",
    hf: HfSpec = None,
    hf_class: HfClass = None,
    precision: PrecisionOpt = None,
    batch: Annotated[int, typer.Option(min=1, help="The batch size to hold fixed.")] = 64,
    levels: Levels = "L0-L5",
    budget: BudgetOpt = None,
    mode: ModeOpt = None,
    device_profile: DeviceProfileOpt = None,
    margin: MarginOpt = None,
    multiple_of: Annotated[int | None, typer.Option(
        min=1, help="Step of the search in units of the dimension (1/8 of the default depth "
        "or width; pixels for resolution, default 8).", show_default=False)] = None,
    max_scale: Annotated[float | None, typer.Option(
        "--max", help="Largest value to try (a multiplier, or pixels).",
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
    """Largest depth, width or input resolution that fits, per optimization level."""
    from actune.tune import run

    with _errors(debug):
        workload, level_list, settings = _setup(model_file, model, levels, budget, mode,
                                                world_size, shard, jobs, hf, hf_class,
                                                precision, device_profile, margin)
        _compile_answers(settings, compile_, compile_backend)
        workload.require(dim)
        _run_job(run.scale, level_list, quiet, json_path, workload=workload,
                 settings=settings, dim=dim, batch=batch,
                 multiple_of=multiple_of, maximum=max_scale)


@app.command(cls=_Command)
def bench(
    model_file: ModelFile = None,
    model: ModelName = "resnet18",
    hf: HfSpec = None,
    hf_class: HfClass = None,
    precision: PrecisionOpt = None,
    levels: Levels = "L0-L5",
    batch: Annotated[int, typer.Option(min=1, help="Batch size for every level.")] = 64,
    at_max: Annotated[bool, typer.Option("--at-max", help="Run each level at its own largest "
                                         "batch under the budget instead.")] = False,
    resolution: BenchResolution = None,
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
    from actune.tune import run

    with _errors(debug):
        if plot is not None:
            _require_matplotlib()
        if compile_ and at_max:
            raise _UsageError("--compile times every level at one batch: drop --at-max")
        _check_backend(compile_backend)
        workload, level_list, settings = _setup(model_file, model, levels, budget, mode, hf=hf,
                                                hf_class=hf_class, precision=precision,
                                                device_profile=device_profile, margin=margin)
        if resolution is None and model_file is None and hf is None:
            resolution = BENCH_BUILTIN_RESOLUTION
        sizes = {"resolution": resolution} if resolution and "resolution" in workload.dims \
            else {}
        report = _run_job(run.bench, level_list, quiet, json_path, workload=workload,
                          settings=settings, batch=batch, at_max=at_max,
                          sizes=sizes, steps=steps, warmup=max(warmup, 1 if compile_ else 0),
                          answer=True, compile=compile_, compile_backend=compile_backend)
        _plot(plot, workload, level_list, settings, report, sizes, quiet)


def _plot(plot: Path | None, workload, level_list, settings, report, sizes: dict,
          quiet: bool) -> None:
    """``--plot``: samples/s of real steps against batch size, each level up to its row's
    batch (its own max batch after maxbatch or bench --at-max)."""
    if plot is None:
        return
    from actune.plot import throughput_curves

    throughput_curves(workload, level_list, settings, report, sizes, plot)
    if not quiet:
        console.print(f"plot written to {plot}")


def _require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise _UsageError("--plot needs matplotlib: pip install 'actune[plot]'") from None


@app.command(cls=_Command)
def train(
    model_file: ModelFile = None,
    model: ModelName = "tinycnn",
    hf: HfSpec = None,
    hf_class: HfClass = None,
    precision: PrecisionOpt = None,
    levels: Annotated[str, typer.Option(help="Levels: L0,L3 or L0-L3; a number of bits such "
                                        "as 2b or 1.25b is mixed precision.")] = "L0,L3",
    epochs: Annotated[int, typer.Option(min=1, help="Epochs per level.")] = 10,
    seed: Annotated[int, typer.Option(help="Seed of the weights, the batches and the "
                                      "rounding (the same for every level).")] = 0,
    batch: Annotated[int, typer.Option(min=1, help="Batch size.")] = 64,
    resolution: Resolution = None,
    every: Annotated[int, typer.Option(min=0, help="Steps between bit re-allocations "
                                       "(mixed-precision levels).")] = 50,
    per_sample: PerSample = True,
    device: Annotated[str | None, typer.Option(help="cpu or cuda. Default: cuda when torch "
                                               "sees a GPU.", show_default=False)] = None,
    compile_: Annotated[bool, typer.Option(
        "--compile", help="Also train each level with its forward under torch.compile, in a "
        "column of its own (the first epoch's seconds include compiling).")] = False,
    compile_backend: CompileBackend = "inductor",
    json_path: JsonOpt = None,
    quiet: Quiet = False,
    debug: Debug = False,
) -> None:
    """Train on real data at each level, side by side: loss, accuracy, time per epoch.

    Default: a small CNN on scikit-learn's digits, which ship offline."""
    import torch

    from actune.levels import parse_levels
    from actune.train import train as run_train

    with _errors(debug):
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        if device not in ("cpu", "cuda") or (device == "cuda" and not torch.cuda.is_available()):
            raise _UsageError(f"--device {device}: use cpu" + (
                " or cuda" if torch.cuda.is_available() else " (torch sees no CUDA device)"))
        work = _workload(model_file, model, hf, hf_class, precision)
        level_list = parse_levels(levels)
        _check_backend(compile_backend)
        data, sizes = _data(work, resolution)
        runs = [(lv, c) for lv in level_list for c in ((False, True) if compile_ else (False,))]
        steps = -(-len(data.x_train) // batch) * epochs * len(runs)
        results: dict[str, list] = {f"{lv.name} compiled" if c else lv.name: []
                                    for lv, c in runs}
        allocators = {}
        progress = _progress_steps(quiet)
        with progress as bar:
            task = bar.add_task("training", total=steps) if bar else None
            for lv, compiled in runs:
                name = f"{lv.name} compiled" if compiled else lv.name
                if bar:
                    bar.update(task, description=name)
                for r in run_train(lambda: work.model(**sizes), data, lv, epochs=epochs,
                                   seed=seed, batch_size=batch, loss_fn=work.loss,
                                   make_optimizer=work.optimizer, every=every,
                                   per_sample=per_sample, device=device,
                                   precision=work.precision, compiled=compiled,
                                   compile_backend=compile_backend,
                                   on_step=(lambda: bar.advance(task)) if bar else None,
                                   keep=lambda _m, ap, name=name: allocators.__setitem__(
                                       name, ap)):
                    results[name].append(r)
                    if json_path is not None:
                        _write_json(_train_json(work.name, seed, results, allocators),
                                    json_path)
        if json_path is not None:
            _write_json(_train_json(work.name, seed, results, allocators), json_path)
        if quiet:
            return
        _render_training(work.name, len(data.x_train), len(data.x_test), seed, results)
        for name, ap in allocators.items():
            if ap is not None and ap.rows():
                _render_allocation(name, ap)
        if json_path:
            console.print(f"JSON written to {json_path}")


def _progress_steps(quiet: bool):
    if quiet:
        return contextlib.nullcontext(None)
    return Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                    TextColumn("{task.completed}/{task.total} steps"), TimeElapsedColumn(),
                    console=console, transient=True)


def _train_json(model: str, seed: int, results: dict, allocators: dict) -> dict:
    return {"schema": "actune.train/1", "model": model, "seed": seed,
            "levels": {name: {"epochs": [r.as_dict() for r in rows],
                              "allocation": _allocation_json(allocators.get(name))}
                       for name, rows in results.items()}}


def _allocation_json(ap) -> dict | None:
    """The allocator's state without its per-dataset-sample table (one number per sample)."""
    if ap is None:
        return None
    state = ap.state_dict()
    table = state.pop("sensitivity")
    state["samples_remembered"] = 0 if table is None else int((table > 0).sum())
    return state


def _render_training(model: str, train_n: int, test_n: int, seed: int, results: dict) -> None:
    table = Table(title=f"actune train: {model}, {train_n} training / {test_n} test samples, "
                  f"seed {seed}", title_justify="left",
                  caption="each cell: mean training loss, training / test accuracy, seconds",
                  caption_justify="left")
    table.add_column("epoch", justify="right")
    for name in results:
        table.add_column(name, justify="right")
    epochs = max((len(rows) for rows in results.values()), default=0)
    for e in range(epochs):
        cells = [str(e + 1)]
        for rows in results.values():
            r = rows[e] if e < len(rows) else None
            cells.append("-" if r is None else
                         f"{r.loss:.4f}\n{100 * r.train_accuracy:.1f} / "
                         f"{100 * r.test_accuracy:.1f}%\n{r.seconds:.1f} s")
        table.add_row(*cells, end_section=True)
    console.print(table)
    base = results.get("L0")
    if base:
        for name, rows in results.items():
            if name != "L0" and rows:
                diff = 100 * (rows[-1].test_accuracy - base[-1].test_accuracy)
                console.print(f"{name}: final test accuracy {diff:+.1f} points vs L0")


def _render_allocation(name: str, ap) -> None:
    table = Table(title=f"{name}: bits per compressed tensor (average {ap.mean_bits:.3f}, "
                  f"{ap.reallocations} allocations; modelled variance {ap.variance:.3g}, "
                  f"{ap.uniform_variance():.3g} at uniform bits)", title_justify="left")
    for col in ("slot", "shape", "bits", "bits by sample rank", "cost C", "variance"):
        table.add_column(col, justify="right" if col != "shape" else "left")
    for r in ap.rows():
        runs = " ".join(f"{k}x{b}" for b, k in r["bits_by_rank"]) if r["bits"] else "mask"
        table.add_row(str(r["slot"]), r["shape"], f"{r['bits']:.2f}", runs,
                      f"{r['cost']:.3g}", f"{r['variance']:.3g}")
    console.print(table)


@app.command(cls=_Command)
def numerics(
    model_file: ModelFile = None,
    model: ModelName = "tinycnn",
    levels: Annotated[str, typer.Option(help="Levels to measure (L0 is the reference and "
                                        "always exact).")] = "L1,u2,L3,1.25b",
    batch: Annotated[int, typer.Option(min=2, help="Batch size.")] = 64,
    repeats: Annotated[int, typer.Option(min=2, help="Rounding seeds per level.")] = 16,
    draws: Annotated[int, typer.Option(min=2, help="Minibatches for SGD's variance.")] = 16,
    resolution: Resolution = None,
    seed: Annotated[int, typer.Option(help="Seed of the weights and the batches.")] = 0,
    layers: Annotated[bool, typer.Option("--layers/--no-layers", help="Show each layer.")]
    = True,
    per_sample: PerSample = True,
    json_path: JsonOpt = None,
    debug: Debug = False,
) -> None:
    """Gradient bias and quantization variance beside SGD's own, per layer and in total.

    ActNN's variance analysis, on real data: SGD's variance is that of the minibatch."""
    import torch

    from actune.levels import parse_levels
    from actune.numerics import measure

    with _errors(debug):
        work = _workload(model_file, model)
        level_list = [lv for lv in parse_levels(levels) if not lv.exact]
        if not level_list:
            raise _UsageError("--levels: give at least one compressing level (L0 is the "
                              "exact reference every level is measured against)")
        data, sizes = _data(work, resolution)
        torch.manual_seed(seed)
        net = work.model(**sizes)
        with console.status("measuring") as status:
            results = measure(net, data, level_list, batch=batch, repeats=repeats,
                              draws=draws, seed=seed, per_sample=per_sample,
                              loss_fn=work.loss,
                              on_progress=lambda name: status.update(f"measuring {name}"))
        title = (f"actune numerics: {work.name}, batch {batch}, {repeats} rounding seeds, "
                 f"SGD variance over {draws} minibatches")
        table = Table(title=title, title_justify="left")
        for col in ("level", "layer", "params", "bias", "bias floor", "quant. variance",
                    "SGD variance", "quant / SGD"):
            table.add_column(col, justify="left" if col in ("level", "layer") else "right")
        for r in results:
            rows = r.layers if layers else []
            for lay in rows:
                table.add_row(r.level, lay.name, f"{lay.numel:,}", f"{lay.bias:.4f}",
                              f"{lay.bias_floor:.4f}", f"{lay.quant_variance:.4g}",
                              f"{lay.sgd_variance:.4g}",
                              f"{lay.quant_variance / lay.sgd_variance:.3f}"
                              if lay.sgd_variance else "-")
            bits = f" ({r.mean_bits:.2f} bits)" if r.mean_bits else ""
            table.add_row(f"[bold]{r.level}[/]", f"[bold]total{bits}[/]",
                          f"{sum(lay.numel for lay in r.layers):,}", f"{r.bias:.4f}",
                          f"{r.bias_floor:.4f}", f"{r.quant_variance:.4g}",
                          f"{r.sgd_variance:.4g}", f"{r.ratio:.3f}",
                          end_section=True)
        console.print(table)
        console.print("bias floor: the bias that the finite number of seeds alone explains "
                      "(an unbiased level stays near it)")
        if json_path is not None:
            _write_json({"schema": "actune.numerics/1", "model": work.name, "seed": seed,
                         "levels": [r.as_dict() for r in results]}, json_path)
            console.print(f"JSON written to {json_path}")


@app.command(cls=_Command)
def summary(
    model_file: ModelFile = None,
    model: ModelName = "resnet50",
    hf: HfSpec = None,
    hf_class: HfClass = None,
    level: Annotated[str, typer.Option(help="The level to convert at.")] = "L3",
    debug: Debug = False,
) -> None:
    """What actune.compress converts, what each layer keeps for backward, what it leaves.

    Layers left as they are say why."""
    import torch

    import actune

    with _errors(debug):
        lv = actune.get_level(level)
        work = _workload(model_file, model, hf, hf_class)
        with torch.device("meta"):  # structure only: no memory for the weights
            net = actune.compress(work.model(), lv)
        table = Table(title=f"actune.compress({work.name}, {lv.name})", title_justify="left")
        for col in ("module", "layer", "converted", "keeps for backward"):
            table.add_column(col)
        rows = actune.summary(net)
        for row in rows:
            table.add_row(row.name, row.layer, "yes" if row.converted else "no", row.keeps)
        console.print(table)
        done = sum(r.converted for r in rows)
        console.print(f"{done} of {len(rows)} layers converted")


@app.command(cls=_Command)
def info(debug: Debug = False) -> None:
    """The device and its memory (NVML), the kernels, and versions."""
    import numba
    import torch

    from actune import __version__
    from actune.levels import LEVELS
    from actune.memory import parse_budget, probe
    from actune.memory.gpu_profiles import PROFILES
    from actune.report import human_bytes

    with _errors(debug):
        dev = probe()
        table = Table(title="actune info", show_header=False, title_justify="left")
        table.add_column(style="bold")
        table.add_column()
        if dev.available:
            table.add_row("GPU", f"{dev.name} (driver {dev.driver})")
            table.add_row("memory", f"{human_bytes(dev.total)} total, {human_bytes(dev.free)} "
                          f"free, {human_bytes(dev.used)} used")
        else:
            table.add_row("GPU", f"none: {dev.reason}")
        budget = parse_budget(None, dev)
        table.add_row("default budget", f"{human_bytes(budget.bytes)} ({budget.source})")
        table.add_row("CPU kernels", f"Numba {numba.__version__}, "
                      f"{numba.get_num_threads()} threads")
        table.add_row("CUDA kernels", "numba-cuda, on torch's current stream"
                      if torch.cuda.is_available() else "not in use (torch sees no CUDA "
                      "device; CPU kernels run instead)")
        table.add_row("device profiles", "; ".join(
            f"{p.name}: {p.describe()}" for p in PROFILES.values()) + " (--device-profile)")
        table.add_row("actune", __version__)
        table.add_row("torch", f"{torch.__version__}")
        table.add_row("python", platform.python_version())
        table.add_row("levels", "; ".join(f"{lv.name}: {lv.description}"
                                          for lv in LEVELS.values()))
        table.add_row("mixed precision", "L3-L5 at 2 bits on average; other averages are "
                      "levels named by their bits (1.25b, 3b, any from 1 to 8); u1, u2, u4, u8: "
                      "the same bits everywhere, no allocator")
        console.print(table)


@app.command(cls=_Command)
def kernels(
    numel: int = typer.Option(16 * 2**20, min=1, help="Elements of the random float32 tensor."),
    group_size: int = typer.Option(256, help="Elements per quantization group."),
    seed: int = typer.Option(0, help="Seed of the tensor and of the rounding."),
) -> None:
    """Quantize a random tensor at 1, 2, 4 and 8 bits: size, error and speed per width."""
    import torch

    from actune import dequantize, quantize

    x = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
    table = Table(title=f"actune kernels: {numel:,} float32 elements, group {group_size}")
    for col in ("bits", "bits/element", "compression", "RMS error / std", "pack Gelem/s",
                "unpack Gelem/s"):
        table.add_column(col, justify="right")
    for bits in (1, 2, 4, 8):
        pack_s = unpack_s = float("inf")
        for _ in range(3):  # the first round compiles (or loads) the kernels: keep the best
            t0 = time.perf_counter()
            p = quantize(x, bits, group_size=group_size, seed=seed)
            t1 = time.perf_counter()
            y = dequantize(p)
            t2 = time.perf_counter()
            pack_s, unpack_s = min(pack_s, t1 - t0), min(unpack_s, t2 - t1)
        rms = ((y - x).pow(2).mean().sqrt() / x.std()).item()
        table.add_row(str(bits), f"{p.bits_per_element:.3f}", f"{x.nbytes / p.nbytes:.1f}x",
                      f"{rms:.3f}", f"{numel / pack_s / 1e9:.2f}", f"{numel / unpack_s / 1e9:.2f}")
    console.print(table)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
