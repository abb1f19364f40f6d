"""Backward inside ``compressed()``: does it hold more than backward after it?

docs/training.md lets ``loss.backward()`` run inside the ``with actune.compressed(...)`` block
or after it, and a training loop may sit inside one block. Three malloc-level peaks
(:func:`actune.memory.heap.allocation_peak`, the profiler's sum of live CPU allocations) per
model, at L3, measured in one run:

* ``outside``: forward inside the block, backward after it;
* ``inside``: forward and backward inside the block;
* ``loop``: 4 steps (forward, backward, SGD) inside one block, against one step inside.

``inside / outside`` near 1.00x and ``4 steps / one`` near 1.00x mean backward frees each packed
value once its reader has run and no step keeps the one before it.

    python benchmarks/backward_inside.py [--models resnet50,gpt2,llama]
"""

from __future__ import annotations

import argparse
import contextlib
import gc

import torch
import torch.nn.functional as F  # noqa: N812
from rich.console import Console
from rich.table import Table

import actune
from actune.apps import zoo
from actune.memory.heap import allocation_peak

MiB = 2**20


def resnet50():
    torch.manual_seed(0)
    model = zoo.resnet(50, num_classes=10)
    x, y = torch.randn(4, 3, 224, 224), torch.randint(0, 10, (4,))
    return model, lambda: F.cross_entropy(model(x), y)


def _hf(kind: str):
    import transformers as t

    torch.manual_seed(0)
    common = {"vocab_size": 8000, "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}
    if kind == "gpt2":
        model = t.GPT2LMHeadModel(t.GPT2Config(n_layer=4, n_embd=256, n_head=4,
                                               n_positions=128, **common))
    else:
        model = t.LlamaForCausalLM(t.LlamaConfig(
            num_hidden_layers=4, hidden_size=256, intermediate_size=688,
            num_attention_heads=4, num_key_value_heads=2, **common))
    ids = torch.randint(0, 8000, (4, 128), generator=torch.Generator().manual_seed(0))
    return model, lambda: model(input_ids=ids, labels=ids).loss


MODELS = {"resnet50": resnet50, "gpt2": lambda: _hf("gpt2"), "llama": lambda: _hf("llama")}


def measure(name: str, level: str) -> dict[str, float]:
    model, loss_of = MODELS[name]()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step(backward_inside: bool, steps: int = 1) -> None:
        outer = actune.compressed(level) if steps > 1 else contextlib.nullcontext()
        with outer:
            for _ in range(steps):
                with actune.compressed(level) if steps == 1 else contextlib.nullcontext():
                    loss = loss_of()
                    if backward_inside:
                        loss.backward()
                if not backward_inside:
                    loss.backward()
                del loss
                opt.step()
                opt.zero_grad(set_to_none=False)

    step(True)  # warm-up: gradients and lazily made state exist before any peak is taken

    def peak(fn) -> float:
        gc.collect()
        return allocation_peak(fn, quiet=True) / MiB

    return {"outside": peak(lambda: step(False)), "inside": peak(lambda: step(True)),
            "loop": peak(lambda: step(True, 4))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--level", default="L3")
    args = parser.parse_args()
    table = Table(title=f"step peaks at {args.level} (MiB above what was held before)")
    for col in ("model", "outside", "inside", "inside / outside", "4 steps inside",
                "4 steps / one"):
        table.add_column(col, justify="right")
    for name in args.models.split(","):
        m = measure(name, args.level)
        table.add_row(name, f"{m['outside']:.1f}", f"{m['inside']:.1f}",
                      f"{m['inside'] / m['outside']:.2f}x", f"{m['loop']:.1f}",
                      f"{m['loop'] / m['inside']:.2f}x")
    Console().print(table)


if __name__ == "__main__":
    main()
