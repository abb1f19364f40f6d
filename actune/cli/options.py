"""The options the ``actune`` commands share, as annotated types."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from actune.cli.app import output_file

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
                                     "ckpt, offload, lce (a causal LM's loss in chunks) and "
                                     "L3+ckpt (docs/tuning.md).")]
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


JsonOpt = Annotated[Path | None, typer.Option(
    "--json", help="Also write the result as JSON (schema actune.result/2) to this path, "
    "atomically, after every finished level.", show_default=False,
    callback=output_file("result.json"))]
Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="No progress and no table "
                                     "(use with --json).")]
Debug = Annotated[bool, typer.Option("--debug", help="Show tracebacks.")]
PerSample = Annotated[bool, typer.Option("--per-sample/--per-tensor", help="Mixed-precision "
                                         "levels (L3-L5, 2b...) choose bits per sample too, or "
                                         "only per tensor.")]
PlotOpt = Annotated[Path | None, typer.Option(
    help="Draw samples/s of real training steps against batch size per level to this PNG, "
    "each level up to its own batch (needs matplotlib).", show_default=False,
    callback=output_file("throughput.png"))]
Jobs = Annotated[int | None, typer.Option(
    "--jobs", "-j", min=1, help="Levels searched side by side in estimate mode, one process "
    "each (default: one per CPU core; 1: one after another).", show_default=False)]
Resolution = Annotated[int | None, typer.Option(min=1, help="Input resolution (images) or "
                                                "sequence length (tokens).", show_default=False)]

LoraOpt = Annotated[int | None, typer.Option(
    "--lora", min=1, help="LoRA adapters of this rank on the linear layers (peft), the "
    "model's own weights frozen: no gradient, no optimizer state for them.",
    show_default=False)]
Tokens = Annotated[int | None, typer.Option(
    "--tokens", "--seq-len", min=1, help="Sequence length of a language model (what "
    "--resolution sets for it).", show_default=False)]
BenchResolution = Annotated[int | None, typer.Option(
    min=1, help="Input resolution (images) or sequence length (tokens); default 32 for the "
    "built-in models (a quick run), a model file's own default for a file.",
    show_default=False)]
#: bench's resolution for the built-in models when none is given.
BENCH_BUILTIN_RESOLUTION = 32
