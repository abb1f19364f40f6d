"""Activation memory per level: bytes autograd keeps for backward, and the peak of a step.

For the built-in ResNet-50 at 224x224 and the small transformer, at L0..L3:

* activation bytes: what is held for backward at the end of the forward pass, each storage
  counted once, parameters excluded (actune.compressed's statistics), and the ratio to L0;
* peak bytes of a whole training step (forward, backward, SGD with momentum, optimizer state
  already allocated), from torch.distributed._tools.mem_tracker.MemTracker, split into
  parameters / gradients / optimizer state / activations / temporaries.

Everything runs under FakeTensorMode: shapes and allocations without arithmetic, so the
figures for a batch of 64 come in seconds on a CPU (``--real`` runs real tensors instead).

    python benchmarks/activation_memory.py [--batch 64] [--real]
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch
import torch.nn.functional as F  # noqa: N812
from rich.console import Console
from rich.table import Table
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker

import actune
from actune.apps import zoo

MiB = 2**20
LEVELS = ("L0", "L1", "L2", "L3")


def measure(name: str, batch: int, level: str, real: bool) -> dict:
    spec = zoo.MODELS[name]
    mode = contextlib.nullcontext() if real else FakeTensorMode()
    with mode, torch.device("cpu"):
        torch.manual_seed(0)
        model = spec.factory()
        actune.allow_inplace_norms(model)  # as the tuner does
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        x, y = zoo.make_batch(spec, batch)

        def step(stats=None):
            opt.zero_grad(set_to_none=True)
            with actune.compressed(level, stats=stats):
                loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()

        step()  # optimizer state allocated: steady state
        held = []
        step(stats=held.append)
        tracker = MemTracker()
        tracker.track_external(model, opt)
        with tracker:
            step()
        peak = next(iter(tracker.get_tracker_snapshot("peak").values()))
    parts = {str(k).split(".")[-1].lower(): v for k, v in peak.items()}
    return {"activations": held[0].saved_bytes if level == "L0" else held[0].kept_bytes,
            "peak": parts.pop("total"), **parts}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--real", action="store_true", help="real tensors (slow on a CPU)")
    args = parser.parse_args()
    console = Console(width=120)
    for name in ("resnet50", "transformer"):
        t0 = time.perf_counter()
        rows = {lv: measure(name, args.batch, lv, args.real) for lv in LEVELS}
        base = rows["L0"]
        spec = zoo.MODELS[name]
        table = Table(title=f"{name}, batch {args.batch}, input {spec.resolution} "
                            f"({'real' if args.real else 'fake'} tensors, "
                            f"{time.perf_counter() - t0:.1f} s)")
        for col in ("level", "saved MiB", "L0/lv", "peak MiB", "L0/lv", "param", "grad",
                    "optim", "act@peak", "temp"):
            table.add_column(col, justify="right")
        for lv, r in rows.items():
            table.add_row(
                lv, f"{r['activations'] / MiB:,.1f}",
                f"{base['activations'] / r['activations']:.2f}x",
                f"{r['peak'] / MiB:,.1f}", f"{base['peak'] / r['peak']:.2f}x",
                *(f"{r.get(k, 0) / MiB:,.1f}" for k in ("param", "grad", "opt", "act", "temp")))
        console.print(table)


if __name__ == "__main__":
    main()
