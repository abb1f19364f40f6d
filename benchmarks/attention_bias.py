"""What rounding attention's q and k does to the gradient: bias against SGD's own noise.

Attention's backward recomputes ``softmax(q k^T)``, nonlinear in q and k: rounding them leaves
a bias (the other saved tensors are rounded where the backward is linear: no bias, only
noise). For a byte-level Hugging Face GPT-2 trained for a while at L0 on Python's own
documentation (``pydoc_data.topics``), the gradient of one batch is compared with the mean of
``--draws`` gradients at each q/k width (everything else at 8 bits, unbiased):

* bias: ``||mean - exact||`` with the variance the finite number of draws explains removed,
  relative to ``||exact||``;
* SGD noise: the spread of the gradients of other batches around the mean gradient, relative
  to the mean gradient's norm, the noise training lives with anyway.

    python benchmarks/attention_bias.py [--draws 64] [--train-steps 150]
"""

from __future__ import annotations

import argparse

import torch
from rich.console import Console
from rich.table import Table

import actune
from actune.levels import Level

try:
    from transformers import GPT2Config, GPT2LMHeadModel
except ImportError as err:
    raise SystemExit("needs Hugging Face transformers: pip install 'actune[hf]'") from err

from hf_accuracy import batches, corpus  # (run as a script: benchmarks/ is on the path)


def flat_grad(model, ids, level) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    with actune.compressed(level):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draws", type=int, default=64)
    parser.add_argument("--train-steps", type=int, default=150)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=128, n_layer=2, n_embd=128,
                                       n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
                                       attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))
    train, _ = corpus()
    it = batches(train, 16, 128, torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    for _ in range(args.train_steps):  # attention that has learned something to attend to
        ids = next(it)
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    ids = next(it)
    exact = flat_grad(model, ids, "L0")
    others = torch.stack([flat_grad(model, next(it), "L0") for _ in range(16)])
    mean = others.mean(0)
    sgd = ((others - mean).norm(dim=1).mean() / mean.norm()).item()
    table = Table(title=f"byte-level GPT-2 (2 layers, 128 wide) after {args.train_steps} steps "
                        f"(loss {loss.item():.2f}): gradient bias from rounding q and k, "
                        f"{args.draws} draws")
    for col in ("q/k bits", "bias / |g|", "noise / |g| (one draw)", "SGD noise / |g|",
                "bias / SGD noise"):
        table.add_column(col, justify="right")
    for bits in (None, 8, 4, 2):
        level = Level(f"qk{bits}", other_bits=8, nonlinear_bits=bits)
        torch.manual_seed(1)
        draws = torch.stack([flat_grad(model, ids, level) for _ in range(args.draws)])
        m = draws.mean(0)
        spread = draws.var(0).sum()
        bias2 = ((m - exact).square().sum() - spread / args.draws).clamp(min=0)
        bias = (bias2.sqrt() / exact.norm()).item()
        noise = (spread.sqrt() / exact.norm()).item()
        table.add_row("exact" if bits is None else str(bits), f"{bias:.4f}", f"{noise:.4f}",
                      f"{sgd:.3f}", f"{bias / sgd:.3f}")
    Console(width=120).print(table)


if __name__ == "__main__":
    main()
