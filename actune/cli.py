"""The ``actune`` command line: parses arguments and renders results; the work is elsewhere."""

from __future__ import annotations

import time

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Compress saved activations to 2 bits and tune what fits in memory.")
console = Console()


@app.command()
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


@app.callback()
def _root() -> None:
    """actune: activation-compressed training for PyTorch."""


def main() -> None:
    app()


if __name__ == "__main__":
    main()
