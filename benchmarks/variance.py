"""Gradient variance per level: the allocator against uniform bits, and against SGD's noise.

For the tiny CNN on digits (8x8) and the built-in small ResNet (ResNet-18 at 32x32, digits
resized to 3 x 32 x 32), batch 64, at initialisation or (``--epochs E``) after E epochs of
training at L3 with bits per sample (seed 0), whose allocator remembered each training
sample's gradient size (used for bits per sample, as ActNN does; ``--per-tensor``: not):

* the variance quantization adds to the gradient (sum over parameters, across rounding
  seeds) at uniform bits (u2: 2 bits, u4: 4 bits) and with the allocator at the same
  average (L3, 4b), and their ratio;
* SGD's own minibatch variance (the same sum, across random batches of 64) next to it;
* the allocator's cost: steady-state step time of L3 against u2, plus the statistics step
  and the re-allocating step after it (one each in ``every``) amortised, as a share of u2's
  step time (rounds interleaved).

    python benchmarks/variance.py [--repeats 16] [--draws 16] [--every 50] [--per-tensor]
                                  [--epochs E] [--no-cost]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F  # noqa: N812
from rich.console import Console
from rich.table import Table

import actune
from actune.apps import zoo
from actune.apps.data import digits
from actune.apps.numerics import measure
from actune.apps.train import train
from actune.levels import get_level

PAIRS = (("u2", "L3"), ("u4", "4b"))


def models():
    yield "tinycnn (digits 8x8)", zoo.tiny_cnn, digits()
    yield ("resnet18 (digits 3x32x32)", lambda: zoo.MODELS["resnet18"].factory(resolution=32),
           digits(32, 3))


def trained(factory, data, epochs: int):
    """The model after ``epochs`` at L3 with bits per sample, and what its allocator knows of
    each training sample's gradient (None, None for 0 epochs)."""
    if not epochs:
        torch.manual_seed(0)
        return factory(), None
    kept = {}
    for _ in train(factory, data, get_level("L3"), epochs=epochs, seed=0, per_sample=True,
                   make_optimizer=lambda p: torch.optim.SGD(p, lr=0.02, momentum=0.9),
                   keep=lambda m, ap: kept.update(model=m, ap=ap)):
        pass
    return kept["model"], kept["ap"].sensitivity


def variance_table(repeats: int, draws: int, console: Console, per_sample: bool,
                   epochs: int) -> None:
    state = f"after {epochs} epochs" if epochs else "at initialisation"
    table = Table(title=f"quantization variance of the gradient, {state}, batch 64, {repeats} "
                  f"seeds; SGD variance over {draws} batches; bits per sample: {per_sample}",
                  title_justify="left")
    for col in ("model", "level", "bits", "quant. variance", "model estimate", "SGD variance",
                "quant / SGD", "uniform / allocated", "bias (floor)"):
        table.add_column(col, justify="left" if col in ("model", "level") else "right")
    for name, factory, data in models():
        net, sensitivity = trained(factory, data, epochs)
        levels = [get_level(n) for pair in PAIRS for n in pair]
        res = {r.level: r for r in measure(net, data, levels, repeats=repeats, draws=draws,
                                           per_sample=per_sample, sensitivity=sensitivity)}
        for uniform, mixed in PAIRS:
            for lv in (uniform, mixed):
                r = res[lv]
                ratio = (f"{res[uniform].quant_variance / r.quant_variance:.2f}x"
                         if lv == mixed else "")
                table.add_row(name, lv, f"{r.mean_bits:.2f}" if r.mean_bits else
                              str(get_level(lv).matmul_bits), f"{r.quant_variance:.4g}",
                              f"{r.model_variance:.4g}" if r.model_variance else "-",
                              f"{r.sgd_variance:.4g}", f"{r.ratio:.3f}", ratio,
                              f"{r.bias:.3f} ({r.bias_floor:.3f})")
        table.add_section()
    console.print(table)


def step_times(level: str, every: int, steps: int, x, y, per_sample: bool) -> list[float]:
    torch.manual_seed(0)
    model = actune.compress(zoo.MODELS["resnet18"].factory(resolution=32), level, every=every,
                            per_sample=per_sample)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    ap = actune.autoprec_of(model)
    ids = torch.arange(len(y))
    out = []
    for _ in range(steps):
        t = time.perf_counter()
        if ap is not None and per_sample:
            ap.samples(ids)  # named, as train() does: the per-step gradient record is timed
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        out.append(time.perf_counter() - t)
    return out


def cost_table(every: int, rounds: int, console: Console, per_sample: bool) -> None:
    data = digits(32, 3)
    x, y = data.x_train[:64], data.y_train[:64]
    steady = {"u2": [], "L3": []}
    stat, alloc = [], []
    for _ in range(rounds):  # interleaved: the machine's drift hits both alike
        for lv in ("u2", "L3"):
            # every=3: statistics on steps 1, 4, 7 (indices 0, 3, 6); the step after each
            # re-allocates (indices 1, 4: one transfer to the host and the allocation); steps
            # at indices 2 and 5 are ordinary ones
            times = step_times(lv, 3, 7, x, y, per_sample)
            steady[lv] += [times[i] for i in ((2, 4, 5) if lv == "u2" else (2, 5))]
            if lv == "L3":
                stat.append(times[3])
                alloc.append(times[4])
    base, mixed = statistics.median(steady["u2"]), statistics.median(steady["L3"])
    extra = (mixed - base + (statistics.median(stat) - mixed) / every
             + (statistics.median(alloc) - mixed) / every)
    table = Table(title=f"allocator cost, resnet18 32x32 batch 64 ({rounds} interleaved rounds, "
                  f"bits per sample: {per_sample})", title_justify="left")
    for col in ("u2 step", "L3 step", "statistics step", "allocating step",
                f"extra per step (every {every})", "share of u2's step"):
        table.add_column(col, justify="right")
    table.add_row(f"{base * 1e3:.1f} ms", f"{mixed * 1e3:.1f} ms",
                  f"{statistics.median(stat) * 1e3:.1f} ms",
                  f"{statistics.median(alloc) * 1e3:.1f} ms", f"{extra * 1e3:.2f} ms",
                  f"{100 * extra / base:.1f}%")
    console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=16)
    parser.add_argument("--draws", type=int, default=16)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--per-tensor", action="store_true",
                        help="bits per tensor only (default: per sample too)")
    parser.add_argument("--epochs", type=int, default=0,
                        help="train this many epochs first (0: at initialisation)")
    parser.add_argument("--no-cost", action="store_true", help="skip the step-time table")
    parser.add_argument("--no-variance", action="store_true", help="only the step-time table")
    args = parser.parse_args()
    console = Console(width=140)
    t0 = time.perf_counter()
    per_sample = not args.per_tensor
    if not args.no_variance:
        variance_table(args.repeats, args.draws, console, per_sample, args.epochs)
    if not args.no_cost:
        cost_table(args.every, args.rounds, console, per_sample)
    print(f"total {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
