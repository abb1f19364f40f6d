"""Accuracy of a LoRA fine-tune: a byte-level Hugging Face model pretrained exactly on English,
then fine-tuned with ``peft`` LoRA on Python source code at each level.

The base model (``--family``, random init, vocabulary of 256 bytes) is pretrained at L0 on
``pydoc_data.topics`` (see ``hf_accuracy.py``) for ``--pretrain-steps`` steps and cached under
``--cache`` (keyed by every setting that shapes it), so a second run starts at once. The
fine-tune text is the standard library's own top-level ``.py`` files (about 4.7 MB, the last
tenth held out): offline, and another kind of text than the pretraining's.

Each run wraps a fresh copy of the base with rank-``--rank`` adapters (alpha twice the rank, no
dropout) on every linear layer of the blocks (``actune.tune.adapters.with_lora``: everything
but the output layer), then trains ``--steps`` steps with the recipe of ``hf_accuracy.py``
(AdamW, warm-up, cosine, clip 1.0, 16 x 128 bytes), with ``actune.compress(model, level)`` or
(``--form compressed``) the forward and loss inside ``with actune.compressed(level)``.

    python benchmarks/lora_accuracy.py [--family llama] [--form compress] [--seeds 3]
                                       [--levels L0,u8,L3] [--json out] [--load a.json,...]
    python benchmarks/lora_accuracy.py --numerics [--levels u8,u2,L3]

``u8`` is the control (see ``hf_accuracy.py``). ``--load`` prints the tables of saved runs.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import hashlib
import json
import sys
import sysconfig
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).parent))
import hf_accuracy  # (the recipe, the corpus and the families)

import actune
from actune.tune.adapters import with_lora


def source_corpus() -> tuple[torch.Tensor, torch.Tensor]:
    """The bytes of the standard library's top-level ``.py`` files, split 90 / 10."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = b"\n\n".join(f.read_bytes() for f in sorted(stdlib.glob("*.py")))
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    cut = int(0.9 * len(data))
    return data[:cut], data[cut:]


def _pretrain_key(args) -> str:
    fields = (args.family, args.layers, args.width, args.context, args.pretrain_steps,
              args.pretrain_lr, args.batch, torch.__version__)
    return hashlib.sha1(repr(fields).encode()).hexdigest()[:12]


def pretrained(args) -> torch.nn.Module:
    """The base model: pretrained at L0 on English (cached under ``--cache``)."""
    path = Path(args.cache) / f"{args.family}-{_pretrain_key(args)}.pt"
    model = hf_accuracy.model_of(args.family, 0, args.layers, args.width, args.context, 0.0)
    if path.exists():
        model.load_state_dict(torch.load(path))
        return model
    train_data, val_data = hf_accuracy.corpus()
    recipe = argparse.Namespace(**{**vars(args), "steps": args.pretrain_steps,
                                   "lr": args.pretrain_lr, "warmup": 100,
                                   "every": args.pretrain_steps})
    opt = torch.optim.AdamW(model.parameters(), lr=args.pretrain_lr, weight_decay=0.01)
    it = hf_accuracy.batches(train_data, args.batch, args.context,
                             torch.Generator().manual_seed(0))
    t0 = time.perf_counter()
    curve = hf_accuracy.run_steps(model, opt, it, recipe, 1, args.pretrain_steps, val_data)
    print(f"pretrained {args.family} in {time.perf_counter() - t0:.0f} s: validation loss "
          f"{curve[-1][1]:.4f} on English")
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), path)
    return model


def fine_tune(base, level: str, seed: int, args, train_data, val_data) -> dict:
    torch.manual_seed(seed)  # the adapters' initialisation
    model = with_lora(copy.deepcopy(base), args.rank)
    scope = contextlib.nullcontext
    if args.form == "compress":
        actune.compress(model, level)
    else:
        def scope():
            return actune.compressed(level)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=0.0)
    it = hf_accuracy.batches(train_data, args.batch, args.context,
                             torch.Generator().manual_seed(seed))
    t0 = time.perf_counter()
    torch.manual_seed(seed + 1000)  # the rounding streams
    curve = [(0, hf_accuracy.validate(model, val_data, args.context))]
    curve += hf_accuracy.run_steps(model, opt, it, args, 1, args.steps, val_data, scope)
    return {"level": level, "seed": seed, "curve": curve, "final": curve[-1][1],
            "seconds": time.perf_counter() - t0}


def numerics(base, args, train_data) -> None:
    """The adapters' gradient at each level against the exact one, after ``--warm`` exact
    steps of the fine-tune (seed 0): bias, and the rounding variance over ``--repeats`` draws
    relative to SGD's own (the variance of the exact gradient over 8 other batches), for the
    A and B matrices apart (Adam scales each parameter's step by its own gradient's size)."""
    torch.manual_seed(0)
    model = with_lora(copy.deepcopy(base), args.rank)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    it = hf_accuracy.batches(train_data, args.batch, args.context,
                             torch.Generator().manual_seed(0))
    hf_accuracy.run_steps(model, opt, it, args, 1, args.warm)
    state = copy.deepcopy(model.state_dict())
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = dict(model.named_parameters())
    is_a = torch.cat([torch.full((params[n].numel(),), "lora_A" in n) for n in names])

    def grad(net, ids, scope=contextlib.nullcontext):
        net.zero_grad(set_to_none=True)
        with scope():
            net(input_ids=ids, labels=ids).loss.backward()
        own = dict(net.named_parameters())
        return torch.cat([own[n].grad.reshape(-1).double() for n in names])

    ids = next(it)
    exact = grad(model, ids)
    sgd = torch.stack([grad(model, next(it)) for _ in range(8)]).var(0)
    table = Table(title=f"{args.family} + LoRA r={args.rank}, after {args.warm} exact steps: "
                        f"the adapters' gradient over {args.repeats} draws")
    for col in ("level", "form", "bias", "(its floor)", "variance / SGD's", "A", "B"):
        table.add_column(col, justify="right")
    for form in ("compress", "compressed"):
        for level in args.levels.split(","):
            net = copy.deepcopy(model)
            scope = contextlib.nullcontext
            if form == "compress":
                actune.compress(net, level)
            else:
                def scope(level=level):
                    return actune.compressed(level)
            draws = []
            for r in range(args.repeats):
                net.load_state_dict(state)
                torch.manual_seed(r)
                draws.append(grad(net, ids, scope))
            g = torch.stack(draws)
            var = g.var(0)
            norm = float(exact.norm())
            table.add_row(level, f"{form}()", f"{float((g.mean(0) - exact).norm()) / norm:.4f}",
                          f"{(float(var.sum()) / args.repeats) ** 0.5 / norm:.4f}",
                          f"{float(var.sum() / sgd.sum()):.3f}",
                          f"{float(var[is_a].sum() / sgd[is_a].sum()):.3f}",
                          f"{float(var[~is_a].sum() / sgd[~is_a].sum()):.3f}")
    Console(width=120).print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=sorted(hf_accuracy.FAMILIES), default="llama")
    parser.add_argument("--form", choices=("compress", "compressed"), default="compress")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--levels", default="L0,u8,L3")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--pretrain-steps", type=int, default=1000)
    parser.add_argument("--pretrain-lr", type=float, default=1e-3)
    parser.add_argument("--cache", default=str(Path(__file__).parent / ".cache"))
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--numerics", action="store_true",
                        help="the adapters' gradient bias and variance at each level, instead "
                             "of training")
    parser.add_argument("--warm", type=int, default=100,
                        help="--numerics: exact fine-tune steps before measuring")
    parser.add_argument("--repeats", type=int, default=8, help="--numerics: rounding draws")
    parser.add_argument("--json", default=None)
    parser.add_argument("--load", default=None, help="comma-separated JSON files to print")
    args = parser.parse_args()
    if args.load:
        levels, runs = hf_accuracy.load(args)
        _report(args, levels, runs)
        return
    torch.set_num_threads(args.threads or max(1, torch.get_num_threads()))
    base = pretrained(args)
    train_data, val_data = source_corpus()
    if args.numerics:
        numerics(base, args, train_data)
        return
    levels = args.levels.split(",")
    runs = [fine_tune(base, lv, seed, args, train_data, val_data)
            for seed in range(args.first_seed, args.first_seed + args.seeds) for lv in levels]
    _report(args, levels, runs)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "runs": runs}, indent=1))


def _report(args, levels: list[str], runs: list[dict]) -> None:
    shown = argparse.Namespace(**{**vars(args), "family": f"{args.family} + LoRA r={args.rank}",
                                   "corpus": "the standard library's source"})
    hf_accuracy.report(shown, levels, runs)


if __name__ == "__main__":
    main()
