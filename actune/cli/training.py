"""``actune train``: real training at each level, side by side."""

from __future__ import annotations

import contextlib
from typing import Annotated

import typer
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from actune.cli.app import Command, UsageError, app, console, errors, write_result
from actune.cli.options import (
    CompileBackend,
    Debug,
    HfClass,
    HfSpec,
    JsonOpt,
    ModelFile,
    ModelName,
    PerSample,
    PrecisionOpt,
    Quiet,
    Resolution,
)
from actune.cli.workloads import check_backend, dataset_and_sizes, load_workload


@app.command(cls=Command)
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

    from actune.apps.train import train as run_train
    from actune.levels import parse_levels

    with errors(debug):
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        if device not in ("cpu", "cuda") or (device == "cuda" and not torch.cuda.is_available()):
            raise UsageError(f"--device {device}: use cpu" + (
                " or cuda" if torch.cuda.is_available() else " (torch sees no CUDA device)"))
        work = load_workload(model_file, model, hf, hf_class, precision)
        level_list = parse_levels(levels)
        check_backend(compile_backend)
        data, sizes = dataset_and_sizes(work, resolution)
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
                        write_result(_train_json(work.name, seed, results, allocators),
                                    json_path)
        if json_path is not None:
            write_result(_train_json(work.name, seed, results, allocators), json_path)
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
    return {"schema": "actune.apps.train/1", "model": model, "seed": seed,
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
