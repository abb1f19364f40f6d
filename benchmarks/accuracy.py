"""Accuracy on real data per level: the small CNN on scikit-learn's digits, several seeds.

Every level trains from the same initial weights on the same batches (per seed); only the
compression differs. Prints, per level, the final test accuracy of each seed, their mean and
the difference to L0 in percentage points (ActNN's claim: < 0.5 points at 2 bits; 1.25 bits
still converges).

    python benchmarks/accuracy.py [--epochs 20] [--seeds 0,1,2] [--levels L0,u2,L3,1.25b]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from rich.console import Console
from rich.table import Table

from actune.apps import zoo
from actune.apps.data import digits
from actune.apps.train import train
from actune.levels import parse_levels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--levels", default="L0,u2,L3,1.25b")
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    seeds = [int(s) for s in args.seeds.split(",")]
    levels = parse_levels(args.levels)
    data = digits()
    final: dict[str, list[float]] = {lv.name: [] for lv in levels}
    loss: dict[str, list[float]] = {lv.name: [] for lv in levels}
    seconds: dict[str, float] = {lv.name: 0.0 for lv in levels}
    bits: dict[str, float | None] = {}
    t0 = time.perf_counter()
    for seed in seeds:
        for lv in levels:
            rows = list(train(zoo.tiny_cnn, data, lv, epochs=args.epochs, seed=seed,
                              batch_size=args.batch,
                              make_optimizer=lambda p: torch.optim.SGD(p, lr=0.01,
                                                                       momentum=0.9)))
            final[lv.name].append(100 * rows[-1].test_accuracy)
            loss[lv.name].append(rows[-1].loss)
            seconds[lv.name] += sum(r.seconds for r in rows)
            bits[lv.name] = rows[-1].mean_bits
    table = Table(title=f"digits, tiny CNN, {args.epochs} epochs, batch {args.batch}, seeds "
                  f"{args.seeds} ({len(data.x_train)} train / {len(data.x_test)} test)",
                  title_justify="left")
    for col in ("level", "bits", "test accuracy per seed (%)", "mean (%)", "vs L0 (points)",
                "final loss", "train s"):
        table.add_column(col, justify="left" if col == "level" else "right")
    base = statistics.mean(final["L0"]) if "L0" in final else None
    for name, accs in final.items():
        mean = statistics.mean(accs)
        diff = f"{mean - base:+.2f}" if base is not None and name != "L0" else "-"
        table.add_row(name, f"{bits[name]:.2f}" if bits[name] else "-",
                      " ".join(f"{a:.2f}" for a in accs), f"{mean:.2f}", diff,
                      f"{statistics.mean(loss[name]):.4f}", f"{seconds[name]:.1f}")
    Console().print(table)
    print(f"total {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
