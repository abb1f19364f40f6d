"""How well the allocator's cost estimate matches the variance each tensor really adds.

For every compressed tensor (slot) of one training step: the allocator's estimate of the
variance it adds at one bit (C + Q; a ReLU output, which needs 2 bits, at 2 bits, scaled by 9)
against the variance measured with that tensor alone at that width and every other at 8 bits,
across rounding seeds, on one batch of 64 digits at initialisation.

    python benchmarks/autoprec_estimate.py [--model tinycnn|resnet18] [--repeats 4]
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.nn.functional as F  # noqa: N812
from rich.console import Console
from rich.table import Table

import actune
from actune import zoo
from actune.data import digits
from actune.numerics import _grads, _layers, _no_dropout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tinycnn", choices=("tinycnn", "resnet18"))
    parser.add_argument("--repeats", type=int, default=4)
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.model == "resnet18":
        model, data = zoo.MODELS["resnet18"].factory(resolution=32), digits(32, 3)
    else:
        model, data = zoo.tiny_cnn(), digits()
    _no_dropout(model)
    names, _ = _layers(model)
    x, y = data.x_train[:64], data.y_train[:64]
    state = copy.deepcopy(model.state_dict())
    actune.compress(model, "2b", every=0)
    ap = actune.autoprec_of(model)
    for _ in range(2):  # a statistics step, then one that allocates from it
        model.load_state_dict(state)
        _grads(model, F.cross_entropy, x, y, names)
    table = Table(title=f"{args.model}: estimated vs measured variance per tensor at its "
                  f"narrowest width ({args.repeats} seeds)", title_justify="left")
    for col in ("slot", "shape", "bits", "estimate", "measured", "measured / estimate"):
        table.add_column(col, justify="left" if col == "shape" else "right")
    allocated = [s.bits.copy() for s in ap.slots]
    for i, s in enumerate(ap.slots):
        if not s.bits.any():
            continue  # kept as a mask: adds nothing
        low = s.min_bits
        for t in ap.slots:
            if t.bits.any():
                t.bits[:] = 8
        s.bits[:] = low
        grads = []
        for r in range(args.repeats):
            model.load_state_dict(state)
            torch.manual_seed(r)
            grads.append(_grads(model, F.cross_entropy, x, y, names))
        scale = (2**low - 1) ** 2  # back to one bit's 1 / B**2
        measured = float(torch.stack(grads).var(0).sum()) * scale
        estimate = float(s.cost.sum() + s.quartic.sum() / scale)
        table.add_row(str(i), s.label, str(low), f"{estimate:.4g}", f"{measured:.4g}",
                      f"{measured / estimate:.2f}" if estimate else "-")
        for t, b in zip(ap.slots, allocated, strict=True):
            t.bits = b.copy()
    Console(width=120).print(table)


if __name__ == "__main__":
    main()
