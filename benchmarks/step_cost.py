"""What L3 costs a Hugging Face transformer's training step on the CPU, side by side.

For each family and depth: one model and exact copies of its weights, each with its own
AdamW: plain PyTorch (L0), ``compress(model, "L3")`` (its loss in chunks, the logits never
whole), the same with the model's own head and loss (``chunk_loss(model, on=False)``: the
step before the loss path), and the plain model's forward and loss inside ``with
actune.compressed("L3")``. One step of each per round, in an order that rotates
every round (so neither drifts of the machine nor the order favour one), ``--rounds`` rounds
after ``--warmup``. Printed: samples/s (median step), and for each form against L0 the median
of the per-round ratios with its interquartile range (the run's own spread), and the ratio of
the medians (the estimator of ``hf_models.py --sections speed`` before).

    python benchmarks/step_cost.py [--families gpt2,llama] [--layers 4,12] [--rounds 15]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from rich.console import Console
from rich.table import Table

import actune

try:
    import transformers
except ImportError as err:
    raise SystemExit("needs Hugging Face transformers: pip install 'actune[hf]'") from err


def build(family: str, layers: int, width: int, vocab: int, tokens: int):
    torch.manual_seed(0)
    if family == "gpt2":
        config = transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=width // 64,
                                         vocab_size=vocab, n_positions=tokens,
                                         bos_token_id=0, eos_token_id=0)
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=width,
                                          intermediate_size=round(width * 8 / 3 / 8) * 8,
                                          num_attention_heads=width // 64,
                                          num_key_value_heads=max(1, width // 128),
                                          vocab_size=vocab, bos_token_id=0, eos_token_id=0,
                                          pad_token_id=0)
        model = transformers.LlamaForCausalLM(config)
    model.config._attn_implementation = "sdpa"
    return model


def variants(model) -> dict[str, tuple]:
    """name -> (model, optimizer, level under compressed() or None)."""
    out = {}
    for name in ("L0", "compress()", "compress(), whole logits", "compressed()"):
        twin = copy.deepcopy(model)
        if name.startswith("compress()"):
            actune.compress(twin, "L3")
        if name == "compress(), whole logits":
            actune.chunk_loss(twin, on=False)
        level = "L3" if name == "compressed()" else None
        out[name] = (twin, torch.optim.AdamW(twin.parameters(), lr=1e-4), level)
    return out


def step(entry, ids) -> float:
    model, opt, level = entry
    t0 = time.perf_counter()
    if level is None:
        loss = model(input_ids=ids, labels=ids).loss
    else:
        with actune.compressed(level):
            loss = model(input_ids=ids, labels=ids).loss
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return time.perf_counter() - t0


def quartiles(values: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], statistics.median(values), q[2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default="gpt2,llama")
    parser.add_argument("--layers", default="4,12")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    ids = torch.randint(0, args.vocab, (args.batch, args.tokens),
                        generator=torch.Generator().manual_seed(0))
    table = Table(title=f"L3 against L0: {args.batch} x {args.tokens} tokens, width "
                        f"{args.width}, vocab {args.vocab}, {torch.get_num_threads()} "
                        f"threads, {args.rounds} rotated rounds")
    for col in ("model", "form", "samples/s", "median ratio (IQR)", "ratio of medians"):
        table.add_column(col, justify="right")
    for family in args.families.split(","):
        for layers in map(int, args.layers.split(",")):
            runs = variants(build(family, layers, args.width, args.vocab, args.tokens))
            names = list(runs)
            for _ in range(args.warmup):
                for name in names:
                    step(runs[name], ids)
            times: dict[str, list[float]] = {name: [] for name in names}
            for r in range(args.rounds):
                order = names[r % len(names):] + names[:r % len(names)]
                for name in order:
                    times[name].append(step(runs[name], ids))
            base = times["L0"]
            for name in names:
                sps = args.batch / statistics.median(times[name])
                if name == "L0":
                    table.add_row(f"{family} {layers}L", name, f"{sps:.1f}", "", "")
                    continue
                lo, mid, hi = quartiles([b / t for b, t in zip(base, times[name], strict=True)])
                table.add_row("", name, f"{sps:.1f}", f"{mid:.2f}x ({lo:.2f}-{hi:.2f})",
                              f"{statistics.median(base) / statistics.median(times[name]):.2f}x")
    Console(width=120).print(table)


if __name__ == "__main__":
    main()
