"""Packing by feature on the CPU: the column layout against the feature-major copy it
replaced, side by side on features-last activations (2 bits, groups of 256).

Before: a transposed copy (torch's ``movedim(...).contiguous()``), the plain kernel on it, and
after dequantizing, the copy back to row-major that backward's matmuls made. Now: the column
kernels read and write the row-major tensor. Printed: the best of ``--repeat`` timings of each
way and their ratio, pack and unpack-to-row-major separately.

    python benchmarks/feature_layout.py [--repeat 30] [--threads N]
"""

from __future__ import annotations

import argparse
import time

import torch
from rich.console import Console
from rich.table import Table

from actune.packing.columns import feature_major
from actune.packing.tensors import dequantize, quantize_checked

SHAPES = ((8, 128, 256), (8, 128, 680), (16, 512, 768), (4, 1024, 2048))


def best(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def measure(shape: tuple[int, ...], repeat: int) -> list[float]:
    """Seconds: pack by copy, pack by columns, unpack + copy back, unpack by columns."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    old = quantize_checked(feature_major(x), 2, 256, 1)
    new = quantize_checked(x, 2, 256, 1, by_feature=True)
    assert new.by_feature and not old.by_feature
    rows = x.numel() // shape[-1]
    return [best(lambda: quantize_checked(feature_major(x), 2, 256, 1), repeat),
            best(lambda: quantize_checked(x, 2, 256, 1, by_feature=True), repeat),
            best(lambda: dequantize(old).reshape(rows, shape[-1]), repeat),
            best(lambda: dequantize(new).reshape(rows, shape[-1]), repeat)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    table = Table(title=f"2-bit pack by feature, {torch.get_num_threads()} threads "
                        f"(best of {args.repeat}, ms)")
    for col in ("shape", "pack: copy + kernel", "pack: columns", "ratio",
                "unpack + copy back", "unpack: columns", "ratio"):
        table.add_column(col, justify="right")
    for shape in SHAPES:
        times = measure(shape, args.repeat)
        ms = [f"{1e3 * t:.3f}" for t in times]
        table.add_row("x".join(map(str, shape)), ms[0], ms[1], f"{times[1] / times[0]:.2f}x",
                      ms[2], ms[3], f"{times[3] / times[2]:.2f}x")
    Console(width=130).print(table)


if __name__ == "__main__":
    main()
