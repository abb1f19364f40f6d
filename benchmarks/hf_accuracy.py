"""Accuracy on real text: byte-level Hugging Face language models trained on Python's own docs.

``pydoc_data.topics`` ships with every Python (about 465 KB of English text about Python): the
last tenth is held out for validation. A small model of one family (``--family``: ``gpt2``,
``llama``, ``qwen2``, ``mistral``, ``mixtral`` (a mixture of experts), and three more GELU
families: ``gpt_neox``, ``phi``, and
``bert`` as a masked LM (:class:`MaskedLM`: the loss of 15% of the bytes, masked); random
init from a config, vocabulary of 256 bytes) is trained at each level, with
``actune.compress(model, level)``, or (``--form compressed``) with the forward and
loss inside ``with actune.compressed(level)`` (no allocator, the README's first form; with one:
``--form compressed-autoprec``); the same steps, data order and seeds, AdamW with
a warm-up and a cosine decay. The validation loss (nats per byte) is recorded every ``--every``
steps and at the end, per seed, with its mean over the seeds.

    python benchmarks/hf_accuracy.py [--family llama] [--form compress] [--steps 1000]
                                     [--seeds 3] [--levels L0,u8,L2,L3]
                                     [--json out] [--load a.json,b.json]

``u8`` (8 bits everywhere: a perturbation far below SGD's noise) is the control: how far a
run moves from L0's when nothing but the rounding differs is the benchmark's resolution.
Without gradient clipping and at a higher learning rate (``--clip 0 --lr 2e-3 --warmup 20``)
this model's training is chaotic: u8 ended 2.2% below L0 and single seeds 6% apart, so no
0.5% difference could be read there. ``--autocast`` runs the training steps' forward and
loss under bf16 ``torch.autocast`` (float32 weights and optimizer, validation in float32), as
mixed-precision training does. ``--load`` prints the tables of runs saved with
``--json`` (levels run in separate processes, side by side: give each ``--threads 1`` and
``NUMBA_NUM_THREADS=1``, or numba's threads oversubscribe the cores: several times slower).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import time
from pathlib import Path
from pydoc_data.topics import topics

import torch
from rich.console import Console
from rich.table import Table

import actune
from actune.convert import _LEVEL_ATTR

try:
    import transformers
except ImportError as err:
    raise SystemExit("needs Hugging Face transformers: pip install 'actune[hf]'") from err


def corpus() -> tuple[torch.Tensor, torch.Tensor]:
    """The bytes of pydoc_data.topics, split 90 / 10 into training and validation."""
    text = "\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8")
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    cut = int(0.9 * len(data))
    return data[:cut], data[cut:]


def batches(data: torch.Tensor, batch: int, context: int, gen: torch.Generator):
    while True:
        start = torch.randint(0, len(data) - context - 1, (batch,), generator=gen)
        yield torch.stack([data[s:s + context] for s in start.tolist()])


def _gpt2(layers: int, width: int, context: int, dropout: float):
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=256, n_positions=context, n_layer=layers, n_embd=width,
        n_head=max(1, width // 32), bos_token_id=0, eos_token_id=0, resid_pdrop=dropout,
        embd_pdrop=dropout, attn_pdrop=dropout))


def _llama_like(config_class, model_class):
    """A Llama-layout family (RMSNorm, rotary, SwiGLU, grouped-query attention): heads of 32,
    half as many KV heads, an intermediate width of 2.75x (Llama's 11008 / 4096, rounded)."""

    def build(layers: int, width: int, context: int, dropout: float):
        heads = max(1, width // 32)
        return getattr(transformers, model_class)(getattr(transformers, config_class)(
            vocab_size=256, hidden_size=width, num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
            intermediate_size=int(2.75 * width) // 16 * 16, max_position_embeddings=context,
            attention_dropout=dropout, bos_token_id=0, eos_token_id=0, pad_token_id=0,
            tie_word_embeddings=False))

    return build


def _gelu_family(config_class, model_class, dropouts):
    """A GELU family (a 4x MLP, heads of 32, no dropout): GPT-NeoX (exact GELU, rotary,
    parallel attention and MLP), Phi (``gelu_new``, partial rotary, parallel blocks)."""

    def build(layers: int, width: int, context: int, dropout: float):
        return getattr(transformers, model_class)(getattr(transformers, config_class)(
            vocab_size=256, hidden_size=width, num_hidden_layers=layers,
            num_attention_heads=max(1, width // 32), intermediate_size=4 * width,
            max_position_embeddings=context, bos_token_id=0, eos_token_id=0,
            tie_word_embeddings=False, **dict.fromkeys(dropouts, dropout)))

    return build


class MaskedLM(torch.nn.Module):
    """A masked language model trained as the causal ones are (``model(input_ids=ids,
    labels=ids).loss``): 15% of the bytes, drawn from the model's own generator in training
    and from a hash of the bytes and their positions in evaluation (the same at every
    validation), are replaced by a mask token (256), and the loss is the cross entropy of
    those bytes alone. The masks do not depend on the level: the rounding draws from the
    global generator, the masks from their own."""

    MASK = 256

    def __init__(self, model: torch.nn.Module, seed: int) -> None:
        super().__init__()
        self.model = model
        self.gen = torch.Generator().manual_seed(seed + 2000)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor):
        if self.training:
            chosen = torch.rand(input_ids.shape, generator=self.gen) < 0.15
        else:
            pos = torch.arange(input_ids.shape[-1])
            chosen = (input_ids * 2654435761 + pos * 40503 + 7) % 1000 < 150
        masked = input_ids.masked_fill(chosen, self.MASK)
        return self.model(input_ids=masked, labels=labels.masked_fill(~chosen, -100))


def _bert(layers: int, width: int, context: int, dropout: float):
    """BERT as a masked LM (exact GELU, post-norm, learned positions, a 4x MLP)."""
    return MaskedLM(transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=257, hidden_size=width, num_hidden_layers=layers,
        num_attention_heads=max(1, width // 32), intermediate_size=4 * width,
        max_position_embeddings=context, hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout, pad_token_id=0)), torch.initial_seed())


#: --family: how to build each family's model (layers, width, context, dropout).
FAMILIES = {
    "gpt2": _gpt2,
    "llama": _llama_like("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": _llama_like("Qwen2Config", "Qwen2ForCausalLM"),  # q, k, v with biases
    "mistral": _llama_like("MistralConfig", "MistralForCausalLM"),
    # a mixture of experts: 8 experts a layer, 2 per token, grouped matmuls
    "mixtral": _llama_like("MixtralConfig", "MixtralForCausalLM"),
    "gpt_neox": _gelu_family("GPTNeoXConfig", "GPTNeoXForCausalLM",
                             ("hidden_dropout", "attention_dropout")),
    "phi": _gelu_family("PhiConfig", "PhiForCausalLM",
                        ("resid_pdrop", "embd_pdrop", "attention_dropout")),
    "bert": _bert,
}


def model_of(family: str, seed: int, layers: int, width: int, context: int,
             dropout: float) -> torch.nn.Module:
    torch.manual_seed(seed)
    return FAMILIES[family](layers, width, context, dropout)


@torch.no_grad()
def validate(model, val: torch.Tensor, context: int, batches_: int = 16) -> float:
    model.eval()
    gen = torch.Generator().manual_seed(1234)
    it = batches(val, 16, context, gen)
    losses = [model(input_ids=(ids := next(it)), labels=ids).loss.item()
              for _ in range(batches_)]
    model.train()
    return statistics.fmean(losses)


def train(level: str, seed: int, args, train_data, val_data) -> dict:
    model = model_of(args.family, seed, args.layers, args.width, args.context, args.dropout)
    scope = contextlib.nullcontext
    if args.form == "compress":
        actune.compress(model, level)
        for part in filter(None, (args.module_bits or "").split(",")):
            # an ablation: these modules' saved tensors at uniform bits, outside the allocator
            suffix, bits = part.split("=")
            for path, module in model.named_modules():
                if path.endswith(suffix) and hasattr(module, _LEVEL_ATTR):
                    setattr(module, _LEVEL_ATTR, actune.get_level(f"u{bits}"))
    elif args.form == "compressed":  # the README's first form: no allocator
        def scope():
            return actune.compressed(level)
    else:  # compressed() with an allocator of our own, as compress() attaches one
        ap = actune.AutoPrecision(avg_bits=actune.get_level(level).avg_bits or 2.0)

        def scope():
            return actune.compressed(level, autoprec=ap)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    gen = torch.Generator().manual_seed(seed)
    it = batches(train_data, args.batch, args.context, gen)
    t0 = time.perf_counter()
    torch.manual_seed(seed + 1000)  # dropout and rounding streams
    curve = run_steps(model, opt, it, args, 1, args.steps, val_data, scope)
    return {"level": level, "seed": seed, "curve": curve, "final": curve[-1][1],
            "seconds": time.perf_counter() - t0}


def learning_rate(args, step: int) -> float:
    """The recipe's schedule: ``--warmup`` steps of warm-up, then cosine decay to a tenth."""
    cosine = 0.55 + 0.45 * math.cos(math.pi * step / args.steps)
    return args.lr * min(1.0, step / args.warmup) * cosine


def run_steps(model, opt, it, args, first: int, last: int, val_data=None,
              scope=contextlib.nullcontext) -> list:
    """Steps ``first``..``last`` of the recipe (the forward and loss inside ``scope()``); the
    validation loss every ``--every`` steps and at ``last`` when ``val_data`` is given."""
    curve = []
    for step in range(first, last + 1):
        for group in opt.param_groups:
            group["lr"] = learning_rate(args, step)
        ids = next(it)
        with scope(), (torch.autocast("cpu", dtype=torch.bfloat16) if args.autocast
                       else contextlib.nullcontext()):
            loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if args.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        if val_data is not None and (step % args.every == 0 or step == last):
            curve.append((step, validate(model, val_data, args.context)))
    return curve


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=sorted(FAMILIES), default="gpt2")
    parser.add_argument("--form", choices=("compress", "compressed", "compressed-autoprec"),
                        default="compress",
                        help="compress(model, level); the forward and loss inside "
                             "compressed(level) (no allocator: the README's first form); or "
                             "inside compressed(level, autoprec=AutoPrecision(...))")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--first-seed", type=int, default=0,
                        help="seeds run: first-seed .. first-seed + seeds - 1 (to split them "
                             "over processes)")
    parser.add_argument("--levels", default="L0,u8,L2,L3")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=100, help="warm-up steps")
    parser.add_argument("--clip", type=float, default=1.0,
                        help="clip the gradient's norm to this (0: no clipping; 1.0 is "
                             "Hugging Face Trainer's default)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--module-bits", default=None,
                        help="an ablation with --form compress: SUFFIX=BITS,... packs what the "
                             "modules whose names end so save at uniform BITS (e.g. "
                             "'dense=4,fc2=4')")
    parser.add_argument("--dropout", type=float, default=0.0,
                        help="GPT-2's dropouts (its default is 0.1: another noise source "
                             "that differs between runs)")
    parser.add_argument("--every", type=int, default=250)
    parser.add_argument("--autocast", action="store_true",
                        help="training steps under bf16 autocast (float32 weights)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--load", default=None, help="comma-separated JSON files to print")
    args = parser.parse_args()
    if args.load:
        levels, runs = load(args)
        report(args, levels, runs)
        return
    torch.set_num_threads(args.threads or max(1, torch.get_num_threads()))
    train_data, val_data = corpus()
    levels = args.levels.split(",")
    runs = [train(lv, seed, args, train_data, val_data)
            for seed in range(args.first_seed, args.first_seed + args.seeds) for lv in levels]
    report(args, levels, runs)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "runs": runs}, f, indent=1)


def load(args) -> tuple[list[str], list[dict]]:
    """The levels and runs saved with ``--json`` in the files ``args.load`` names (runs of
    another form than the first file's named apart); ``args`` takes the settings they were run
    with."""
    loaded = [json.loads(Path(f).read_text()) for f in args.load.split(",")]
    runs = [r for data in loaded for r in data["runs"]]
    first = loaded[0]["args"].get("form", "compress")
    for data in loaded:
        form = data["args"].get("form", "compress")
        if form != first:
            for r in data["runs"]:
                r["level"] = f"{r['level']} {form}()"
    for key in ("family", "form", "layers", "width", "context"):
        setattr(args, key, loaded[0]["args"].get(key, getattr(args, key)))
    args.seeds = len({r["seed"] for r in runs})
    args.steps = runs[0]["curve"][-1][0]
    return list(dict.fromkeys(r["level"] for r in runs)), runs


def report(args, levels: list[str], runs: list[dict]) -> None:
    """The validation losses per level and seed, and the mean curves."""
    final = {lv: statistics.fmean(r["final"] for r in runs if r["level"] == lv) for lv in levels}
    table = Table(title=f"byte-level {args.family} ({args.form}; {args.layers} layers, "
                        f"{args.width} wide, {args.context} tokens) on "
                        f"{getattr(args, 'corpus', 'pydoc_data.topics')}, "
                        f"{args.steps} steps, {args.seeds} seeds"
                        f"{', bf16 autocast' if getattr(args, 'autocast', False) else ''}: "
                        "validation loss (nats/byte)")
    seeds = sorted({r["seed"] for r in runs})
    for col in ("level", *(f"seed {s}" for s in seeds), "mean", "vs L0", "s/run"):
        table.add_column(col, justify="right")
    for lv in levels:
        mine = [r for r in runs if r["level"] == lv]
        table.add_row(lv, *(f"{r['final']:.4f}" for r in mine), f"{final[lv]:.4f}",
                      f"{100 * (final[lv] / final[levels[0]] - 1):+.2f}%",
                      f"{statistics.fmean(r['seconds'] for r in mine):.0f}")
    Console(width=120).print(table)
    curves = Table(title=f"mean validation loss by step (and against {levels[0]}'s)")
    curves.add_column("step", justify="right")
    for lv in levels:
        curves.add_column(lv, justify="right")
    steps = [s for s, _ in runs[0]["curve"]]
    for i, step in enumerate(steps):
        mean = {lv: statistics.fmean(r["curve"][i][1] for r in runs if r["level"] == lv)
                for lv in levels}
        curves.add_row(str(step), *(
            f"{mean[lv]:.4f}" + ("" if lv == levels[0] else
                                 f" ({100 * (mean[lv] / mean[levels[0]] - 1):+.2f}%)")
            for lv in levels))
    Console(width=140).print(curves)


if __name__ == "__main__":
    main()
