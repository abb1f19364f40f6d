"""Where a compressed run loses accuracy late in training: from one exact state, the last part of
the run under each variant.

``benchmarks/hf_accuracy.py`` trains each level from the start; a gap that opens late is then
read off the difference of two whole runs, whose seeds spread wider than the gap. Here a model
(``--family``, built as there) trains at L0 to step ``--switch`` of the same recipe (AdamW,
warm-up, cosine decay, clip 1.0; the state is cached in ``--cache``); from that state each
variant trains to ``--steps`` with the same batches, ``--draws`` rounding seeds each. The L0
continuation is the reference; the validation loss every ``--every`` steps is the curve.

A variant is a level, optionally with changes joined by ``+``:

- ``act8`` (``act4``...): the activation-function modules (``.act``, ``.act_fn``) packed at
  that uniform width, the rest as the level has it (more bytes: an ablation);
- ``norm8``, ``head8``: the same for the norms, and the LM head's input;
- ``x-RULE``: the rule for ``RULE`` removed (``gelu``, ``sdpa``, ``loss``, ``norm``): what that op
  saves stays exact;
- ``noap``: the allocator's bits per sample off;
- ``codes2`` (``codes4``): GELU's derivative kept as the index of its nearest level among 4
  (16) fixed ones (``Level.derivative_codes``) instead of its input (L3's
  ``gelu_input_bits``); ``rounded``: the derivative rounded at the level's widths instead;
- ``dcost100`` (any factor): the allocator's estimated cost of every packed derivative (its
  slots with a 2-bit floor that keep no exact zeros) multiplied by that factor before it
  allocates: what ranking derivatives higher within the same budget buys.

    python benchmarks/late_phase.py --family gpt2 --variants L0,u8,L3,L3+act8 --draws 3
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from pathlib import Path

import torch
from hf_accuracy import batches, corpus, model_of, run_steps, validate
from rich.console import Console
from rich.table import Table

import actune
from actune import rules
from actune.convert import _LEVEL_ATTR

#: ``x-NAME``: the functions whose rules are removed (by name)
REMOVABLE = {"gelu": ("gelu",), "sdpa": ("scaled_dot_product_attention",),
             "loss": ("cross_entropy",), "norm": ("layer_norm", "rms_norm")}
#: ``NAMEbits``: which modules a width applies to (by the end of their names)
MODULES = {"act": (".act", ".act_fn"), "norm": ("ln_1", "ln_2", "ln_f", "norm", "layernorm"),
           "head": ("lm_head",)}


@contextlib.contextmanager
def variant(model, name: str):
    """Apply variant ``name`` to ``model`` (compressing it); rules removed come back after."""
    level, *changes = name.split("+")
    saved = dict(rules.RULES)
    try:
        if level != "L0":
            codes = [int(c[5:]) for c in changes if c.startswith("codes")]
            # (codes or a rounded derivative in place of GELU's kept input)
            gelu = ({"derivative_codes": codes[0], "gelu_input_bits": None} if codes else
                    {"derivative_codes": None, "gelu_input_bits": None}
                    if "rounded" in changes else {})
            actune.compress(model, actune.get_level(level).with_(**gelu) if gelu else level,
                            per_sample="noap" not in changes)
        for change in changes:
            if change.startswith("codes") or change == "rounded":
                continue
            if change.startswith("x-"):
                names = set(REMOVABLE[change[2:]])
                for func in [f for f in rules.RULES if getattr(f, "__name__", None) in names]:
                    del rules.RULES[func]
            elif change.startswith("dcost"):
                scale_derivatives(actune.autoprec_of(model), float(change[5:]))
            elif change != "noap":
                kind = change.rstrip("0123456789")
                width = actune.get_level(f"u{change[len(kind):]}")
                for path, module in model.named_modules():
                    if path.endswith(MODULES[kind]) and hasattr(module, _LEVEL_ATTR):
                        setattr(module, _LEVEL_ATTR, width)
        yield
    finally:
        rules.RULES.clear()
        rules.RULES.update(saved)


def scale_derivatives(ap, factor: float) -> None:
    """Make ``ap`` rank its derivative slots ``factor`` times costlier (this instance only)."""
    fold = ap._fold

    def scaled() -> None:
        fold()
        for slot in ap.slots:
            if slot.min_bits == 2 and not slot.zero_code and slot.cost is not None:
                slot.cost = slot.cost * factor
        ap.allocate()

    ap._fold = scaled


def start(args, seed: int, train_data):
    """The model, optimizer and batch generator at step ``--switch`` (cached)."""
    model = model_of(args.family, seed, args.layers, args.width, args.context, 0.0)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    gen = torch.Generator().manual_seed(seed)
    cache = Path(args.cache) / (f"{args.family}-{args.layers}x{args.width}-seed{seed}-"
                                f"{args.switch}of{args.steps}.pt")
    if cache.exists():
        state = torch.load(cache, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        gen.set_state(state["gen"])
    else:
        torch.manual_seed(seed + 1000)
        run_steps(model, opt, batches(train_data, args.batch, args.context, gen), args, 1,
                  args.switch)
        cache.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                    "gen": gen.get_state()}, cache)
    return model, opt, gen


def recipe_arguments(parser: argparse.ArgumentParser) -> None:
    """The recipe's options and the cached state's (shared with derivative_noise.py)."""
    parser.add_argument("--family", default="gpt2")
    parser.add_argument("--switch", type=int, default=750)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--cache", default=".late_phase")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default="L0,u8,L3,L3+act8")
    parser.add_argument("--seeds", default="0", help="comma-separated model seeds")
    parser.add_argument("--draws", type=int, default=2, help="rounding seeds per variant")
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--threads", type=int, default=1)
    recipe_arguments(parser)
    parser.add_argument("--json", default=None)
    parser.add_argument("--load", default=None, help="comma-separated JSON files to print")
    args = parser.parse_args()
    if args.load:
        runs = [r for f in args.load.split(",") for r in json.loads(Path(f).read_text())]
        report(runs)
        return
    torch.set_num_threads(args.threads)
    train_data, val_data = corpus()
    runs = []
    for seed in map(int, args.seeds.split(",")):
        for name in args.variants.split(","):
            for draw in range(1 if name == "L0" else args.draws):
                model, opt, gen = start(args, seed, train_data)
                it = batches(train_data, args.batch, args.context, gen)
                with variant(model, name):
                    torch.manual_seed(draw + 77)
                    t0 = time.perf_counter()
                    first = [(args.switch, validate(model, val_data, args.context))]
                    curve = first + run_steps(model, opt, it, args, args.switch + 1,
                                              args.steps, val_data)
                runs.append({"family": args.family, "seed": seed, "variant": name,
                             "draw": draw, "curve": curve,
                             "seconds": time.perf_counter() - t0})
    report(runs)
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=1))


def report(runs: list[dict]) -> None:
    """Each variant's loss against the L0 continuation of the same seed, along the curve."""
    ref = {r["seed"]: r["curve"] for r in runs if r["variant"] == "L0"}
    names = list(dict.fromkeys(r["variant"] for r in runs if r["variant"] != "L0"))
    steps = [s for s, _ in next(iter(ref.values()))]
    table = Table(title=f"{runs[0]['family']}: from L0's state at step {steps[0]}, each "
                        f"variant to step {steps[-1]}; validation loss against L0's (mean of "
                        f"seeds x draws, and per run at the end)")
    table.add_column("variant")
    for step in steps[1:]:
        table.add_column(str(step), justify="right")
    table.add_column("runs at the end", justify="left")
    for name in names:
        mine = [r for r in runs if r["variant"] == name and r["seed"] in ref]
        gaps = [[100 * (v / ref[r["seed"]][i][1] - 1) for i, (_, v) in enumerate(r["curve"])]
                for r in mine]
        table.add_row(name, *(f"{statistics.fmean(g[i] for g in gaps):+.2f}%"
                              for i in range(1, len(steps))),
                      " ".join(f"{g[-1]:+.2f}" for g in gaps))
    Console(width=140).print(table)


if __name__ == "__main__":
    main()
