"""How well the allocator's cost estimate matches the variance each tensor really adds.

For every compressed tensor (slot) of one training step, on one batch of 64 digits at
initialisation: the variance it adds alone (every other tensor at 8 bits), across rounding
seeds, at its two narrowest widths (1 and 2 bits; a ReLU output, which needs 2, at 2 and 4).
The two give its measured costs C and Q (variance = C / B**2 + Q / B**4, B = 2**bits - 1),
set against the allocator's estimates. Then, at 2 and 4 bits on average, the variance (by the
measured costs) of uniform bits, of the allocation the measured costs give (the best an
allocator of whole tensors can reach), and of the allocation the estimates give.

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
from actune.apps import zoo
from actune.apps.data import digits
from actune.apps.numerics import _grads, _layers, _no_dropout
from actune.autoprec.allocator import allocate, objective


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
    allocated = [s.bits.copy() for s in ap.slots]

    def alone(slot, bits: int) -> float:
        for t in ap.slots:
            if t.bits.any():
                t.bits[:] = 8
        slot.bits[:] = bits
        grads = []
        for r in range(args.repeats):
            model.load_state_dict(state)
            torch.manual_seed(r)
            grads.append(_grads(model, F.cross_entropy, x, y, names))
        for t, b in zip(ap.slots, allocated, strict=True):
            t.bits = b.copy()
        return float(torch.stack(grads).var(0).sum())

    table = Table(title=f"{args.model}: costs per tensor, estimated and measured ({args.repeats} "
                  f"seeds)", title_justify="left")
    for col in ("slot", "shape", "C estimated", "C measured", "Q estimated", "Q measured",
                "variance at its narrowest width, measured / estimated"):
        table.add_column(col, justify="left" if col == "shape" else "right")
    rows = []
    for i, s in enumerate(ap.slots):
        if not s.bits.any():
            continue  # kept as a mask: adds nothing
        b1, b2 = (1, 2) if s.min_bits == 1 else (2, 4)
        v1, v2 = alone(s, b1), alone(s, b2)
        n1, n2 = 1 / (2**b1 - 1) ** 2, 1 / (2**b2 - 1) ** 2
        # v = C n + Q n**2 at both widths
        q = max((v1 * n2 - v2 * n1) / (n1 * n1 * n2 - n2 * n2 * n1), 0.0)
        c = max((v1 - q * n1 * n1) / n1, 0.0)
        est_c, est_q = float(s.cost.sum()), float(s.quartic.sum())
        est_v = est_c * n1 + est_q * n1 * n1
        rows.append((s, c, q, est_c, est_q))
        table.add_row(str(i), s.label, f"{est_c:.4g}", f"{c:.4g}", f"{est_q:.4g}", f"{q:.4g}",
                      f"{v1 / est_v:.2f}" if est_v else "-")
    Console(width=130).print(table)
    costs = [r[1] for r in rows]
    quartic = [r[2] for r in rows]
    numel = [r[0].per_sample_numel for r in rows]
    lo = [r[0].min_bits for r in rows]
    for avg in (2.0, 4.0):
        uniform = objective(costs, [max(int(avg), b) for b in lo], quartic)
        best = objective(costs, allocate(costs, numel, avg, lo, quartic), quartic)
        estimated = objective(costs, allocate([r[3] for r in rows], numel, avg, lo,
                                              [r[4] for r in rows]), quartic)
        print(f"{avg:g} bits on average, variance by the measured costs: uniform {uniform:.4g}; "
              f"allocated from the measured costs {best:.4g} ({uniform / best:.2f}x); from the "
              f"estimates {estimated:.4g} ({uniform / estimated:.2f}x)")


if __name__ == "__main__":
    main()
