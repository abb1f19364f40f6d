"""Which rule's rounding noise reaches which parameters: gradient noise per parameter group of a
byte-level Hugging Face model, with one rule at a time kept exact.

The model (``--family``, built as ``benchmarks/hf_accuracy.py`` builds it) first trains
``--warm`` steps at L0 on ``pydoc_data.topics``. At that state, on one batch, the gradient is
taken ``--draws`` times at ``--level`` (different rounding seeds) and its variance summed per
parameter group (q, k, v, o projections, gate, up, down, norms, embedding, head), against the
variance of the exact gradient over ``--draws`` other batches of the same size: SGD's own
noise. Below 1, rounding is the smaller noise; the training cost of a ratio shows in
``hf_accuracy.py``. ``--ablate`` runs the same with the listed rules removed from the
registry (what those ops save then stays exact: the rule's share of the noise):

    python benchmarks/rule_noise.py --family llama --level u2 --ablate none,mul,norm,linear
"""

from __future__ import annotations

import argparse
import copy
import statistics

import torch
from hf_accuracy import FAMILIES, batches, corpus, model_of
from rich.console import Console
from rich.table import Table

import actune
from actune import rules

#: --ablate names: the functions whose rules are removed (by name).
ABLATIONS = {
    "mul": ("mul", "__mul__", "__rmul__", "mul_", "__imul__"),
    "silu": ("silu",), "gelu": ("gelu",),
    "norm": ("rms_norm", "layer_norm"),
    "sdpa": ("scaled_dot_product_attention",),
    "loss": ("cross_entropy",),
    "linear": ("linear", "addmm", "matmul"),
    "embedding": ("embedding",),
}
GROUPS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
          "input_layernorm", "post_attention_layernorm", "c_attn", "c_proj", "c_fc", "ln_1",
          "ln_2", "embed_tokens", "wte", "wpe", "norm", "ln_f", "lm_head",
          # GPT-NeoX's and Phi's
          "query_key_value", "dense_h_to_4h", "dense_4h_to_h", "dense", "fc1", "fc2",
          "final_layernorm", "final_layer_norm", "embed_in", "embed_out")


def group_of(name: str) -> str:
    return next((g for g in GROUPS if g in name), name)


def gradients(model, ids, level, form: str) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    if level is not None and form != "compress":
        with actune.compressed(level, autoprec=model.ap):
            loss = model(input_ids=ids, labels=ids).loss
    else:
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def variance(samples: list[dict], names: list[str]) -> dict[str, float]:
    out: dict[str, float] = {}
    for n in names:
        v = torch.stack([s[n] for s in samples]).var(0).sum().item()
        out[group_of(n)] = out.get(group_of(n), 0.0) + v
    return out


def bias(samples: list[dict], exact: dict, names: list[str]) -> dict[str, float]:
    """Squared distance of the draws' mean from the exact gradient, less what the draws'
    own variance explains (``var / K``): near 0 for an unbiased rule, per group."""
    out: dict[str, float] = {}
    k = len(samples)
    for n in names:
        stack = torch.stack([s[n] for s in samples])
        excess = (stack.mean(0) - exact[n]).pow(2).sum().item() - stack.var(0).sum().item() / k
        out[group_of(n)] = out.get(group_of(n), 0.0) + excess
    return out


def ablated(parts: list[str]) -> dict:
    """Remove the rules of ``parts`` from the registry; returns the registry to restore."""
    saved = dict(rules.RULES)
    names = {n for p in parts for n in ABLATIONS[p]}
    for func in list(rules.RULES):
        if getattr(func, "__name__", None) in names:
            del rules.RULES[func]
    return saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=sorted(FAMILIES), default="llama")
    parser.add_argument("--form", choices=("compress", "compressed", "compressed-autoprec"),
                        default="compress",
                        help="as in hf_accuracy.py: compressed() has no allocator")
    parser.add_argument("--level", default="u2")
    parser.add_argument("--ablate", default="none",
                        help="comma-separated runs, each 'none' or rules joined by "
                             f"'+' ({', '.join(ABLATIONS)})")
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--warm", type=int, default=150, help="L0 steps before measuring")
    parser.add_argument("--draws", type=int, default=8)
    parser.add_argument("--checkpoint", choices=("none", "reentrant", "non-reentrant"),
                        default="none", help="Hugging Face gradient checkpointing of every "
                                             "block, in that mode (the exact gradient without)")
    parser.add_argument("--boundary-bits", type=int, default=None,
                        help="bits of a checkpointed block's inputs (default: the level's)")
    parser.add_argument("--bias", action="store_true",
                        help="also print each group's squared bias (mean of the draws against "
                             "the exact gradient, less var/K) over SGD's variance")
    args = parser.parse_args()
    train, _ = corpus()
    model = model_of(args.family, 0, args.layers, args.width, 128, 0.0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    it = batches(train, 16, 128, torch.Generator().manual_seed(0))
    for _ in range(args.warm):
        ids = next(it)
        opt.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    names = [n for n, _ in model.named_parameters()]
    ids = next(it)
    sgd = variance([gradients(model, next(it), None, args.form) for _ in range(args.draws)],
                   names)
    level = actune.get_level(args.level)
    if args.boundary_bits is not None:
        level = level.with_(name=f"{level.name}, boundary {args.boundary_bits} bits",
                            boundary_bits=args.boundary_bits)
    exact = gradients(model, ids, None, args.form)
    groups = list(dict.fromkeys(map(group_of, names)))
    table = Table(title=f"{args.family} ({args.form}, checkpoint {args.checkpoint}) at "
                        f"{level.name} after {args.warm} L0 "
                        f"steps: rounding variance / SGD variance, {args.draws} draws")
    table.add_column("rules removed")
    table.add_column("total", justify="right")
    for g in groups:
        table.add_column(g, justify="right")
    for run in args.ablate.split(","):
        parts = [] if run == "none" else run.split("+")
        saved = ablated(parts)
        try:
            twin = copy.deepcopy(model)
            twin.ap = None
            if args.checkpoint != "none":
                twin.gradient_checkpointing_enable(
                    {"use_reentrant": args.checkpoint == "reentrant"})
            if args.form == "compress":
                actune.compress(twin, level)
            elif args.form == "compressed-autoprec" and level.avg_bits:
                twin.ap = actune.AutoPrecision(avg_bits=level.avg_bits)
            torch.manual_seed(5)
            draws = [gradients(twin, ids, level, args.form) for _ in range(args.draws)]
            quant = variance(draws, names)
        finally:
            rules.RULES.clear()
            rules.RULES.update(saved)
        table.add_row(run, f"{sum(quant.values()) / sum(sgd.values()):.3f}",
                      *(f"{quant[g] / sgd[g]:.2f}" for g in groups))
        if args.bias:
            off = bias(draws, exact, names)
            table.add_row(f"{run}: bias²", f"{sum(off.values()) / sum(sgd.values()):.4f}",
                          *(f"{off[g] / sgd[g]:.3f}" for g in groups))
    Console(width=250).print(table)
    print(f"SGD variance total {statistics.fsum(sgd.values()):.4g}")


if __name__ == "__main__":
    main()
