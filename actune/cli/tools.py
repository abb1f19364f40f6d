"""``actune numerics``, ``summary``, ``info`` and ``kernels``: what the library does to a
model's gradients, what it converts, the machine, and the kernels' speed."""

from __future__ import annotations

import platform
import time
from typing import Annotated

import typer
from rich.table import Table

from actune.cli.app import Command, UsageError, app, console, errors, write_result
from actune.cli.options import (
    Debug,
    HfClass,
    HfSpec,
    JsonOpt,
    ModelFile,
    ModelName,
    PerSample,
    Resolution,
)
from actune.cli.workloads import dataset_and_sizes, load_workload


@app.command(cls=Command)
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

    from actune.apps.numerics import measure
    from actune.levels import parse_levels

    with errors(debug):
        work = load_workload(model_file, model)
        level_list = [lv for lv in parse_levels(levels) if not lv.exact]
        if not level_list:
            raise UsageError("--levels: give at least one compressing level (L0 is the "
                              "exact reference every level is measured against)")
        data, sizes = dataset_and_sizes(work, resolution)
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
            write_result({"schema": "actune.apps.numerics/1", "model": work.name, "seed": seed,
                         "levels": [r.as_dict() for r in results]}, json_path)
            console.print(f"JSON written to {json_path}")


@app.command(cls=Command)
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

    with errors(debug):
        lv = actune.get_level(level)
        work = load_workload(model_file, model, hf, hf_class)
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


@app.command(cls=Command)
def info(debug: Debug = False) -> None:
    """The device and its memory (NVML), the kernels, and versions."""
    import numba
    import torch

    from actune import __version__
    from actune.levels import LEVELS
    from actune.memory import parse_budget, probe
    from actune.memory.gpu_profiles import PROFILES
    from actune.tune.report import human_bytes

    with errors(debug):
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


@app.command(cls=Command)
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
