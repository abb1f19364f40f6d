"""What an activation function's packed derivative costs the gradient: the allocator's model
against a measurement, and where the noise lands.

From the state ``benchmarks/late_phase.py`` caches (a model trained at L0 to ``--switch`` of its
recipe; trained here if missing), one batch. The allocator's modelled variance for each derivative
slot at 2 bits (``cost / 9``, after two ``compress(model, "L3")`` steps) against the measured one:
the model at 8 bits everywhere (``u8``), then one activation module at 2 bits, ``--draws``
rounding seeds each; the summed per-parameter variance over u8's. For each, the parameter
groups that receive most of it, raw and relative to their own gradient's squared norm (what an
optimizer that normalises per parameter, such as Adam, feels).

    python benchmarks/derivative_noise.py --family gpt2 [--seed 0] [--draws 24]
"""

from __future__ import annotations

import argparse
import copy
import sys

import torch
from hf_accuracy import batches, corpus
from late_phase import MODULES, recipe_arguments, start

import actune
from actune.convert import _LEVEL_ATTR


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--draws", type=int, default=24)
    parser.add_argument("--top", type=int, default=4)
    recipe_arguments(parser)
    args = parser.parse_args()
    torch.set_num_threads(1)
    train_data, _ = corpus()
    base, _, _ = start(args, args.seed, train_data)
    ids = next(batches(train_data, args.batch, args.context, torch.Generator().manual_seed(5)))
    names = [n for n, _ in base.named_parameters()]

    def grads(model) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()
        return [p.grad.detach().clone() for p in model.parameters()]

    def variance(model) -> list[float]:
        torch.manual_seed(3)
        draws = [grads(model) for _ in range(args.draws)]
        return [torch.stack([d[i] for d in draws]).var(0).sum().item()
                for i in range(len(names))]

    modelled = copy.deepcopy(base)
    actune.compress(modelled, "L3")
    grads(modelled)
    grads(modelled)  # (the first step's statistics are folded at the second's start)
    inner = (4 * args.width, int(2.75 * args.width) // 16 * 16)  # GPT-2's, Llama's MLP width
    slots = [r for r in actune.autoprec_of(modelled).rows()  # derivatives: (batch, tokens, inner)
             if r["shape"] in {f"({args.batch}, {args.context}, {w})" for w in inner}]
    exact = [g.square().sum().item() for g in grads(base)]
    floor = copy.deepcopy(base)
    actune.compress(floor, "u8")
    v8 = variance(floor)
    acts = [n for n, m in base.named_modules() if n.endswith(MODULES["act"])]
    for i, path in enumerate(acts):
        model = copy.deepcopy(base)
        actune.compress(model, "u8")
        setattr(dict(model.named_modules())[path], _LEVEL_ATTR, actune.get_level("u2"))
        extra = [max(v - b, 0.0) for v, b in zip(variance(model), v8, strict=True)]
        total = sum(extra)
        model_var = slots[i]["cost"] / 9 if i < len(slots) else float("nan")
        print(f"{path}: measured {total:.4g}, modelled {model_var:.4g} "
              f"({total / model_var if model_var else float('nan'):.0f}x)")
        order = sorted(range(len(names)), key=lambda k: -extra[k])[:args.top]
        for k in order:
            print(f"    {names[k]:42s} {100 * extra[k] / max(total, 1e-30):3.0f}% of it, "
                  f"{100 * extra[k] / max(exact[k], 1e-30):6.2f}% of the group's |grad|^2")
        by_relative = max(range(len(names)), key=lambda k: extra[k] / max(exact[k], 1e-30))
        print(f"    largest relative to its gradient: {names[by_relative]} "
              f"({100 * extra[by_relative] / max(exact[by_relative], 1e-30):.2f}%)")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
