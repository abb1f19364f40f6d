"""PyTorch's own transformer blocks under compressed(): what is saved, and what is kept.

``nn.TransformerEncoderLayer`` (128 wide, 4 heads, feed-forward 512, pre-norm, batch first,
a batch of 16 x 128 tokens) at dropout 0 and 0.1, and with its padding masked (sequences of 8
to 128 tokens), a small ``nn.Transformer`` (one encoder
and one decoder layer, causal target) and ``nn.MultiheadAttention`` called with its defaults
(the attention weights returned too), each eager and compiled (Inductor), a step
under ``compressed("L3")``: the bytes autograd would keep, the bytes kept, their ratio, what
stayed exact, and Dynamo's graph breaks. ``--without-multihead`` runs with actune's rule for
``F.multi_head_attention_forward`` removed (both forms), as before it existed.

    python benchmarks/pytorch_blocks.py [--without-multihead]
"""

from __future__ import annotations

import argparse
import warnings

import torch
import torch._dynamo
import torch.nn.functional as F  # noqa: N812
from torch import nn
from torch._dynamo.utils import counters

import actune
from actune.rules import RULES
from actune.traced import TRACED

MIB = 2**20


def _encoder(dropout: float):
    layer = nn.TransformerEncoderLayer(128, 4, 512, dropout=dropout, batch_first=True,
                                       norm_first=True)
    x = torch.randn(16, 128, 128)
    return layer, lambda run: run(x)


def _padded_encoder():
    """A batch of sequences of other lengths, its padding masked (a typical NLP batch)."""
    layer = nn.TransformerEncoderLayer(128, 4, 512, dropout=0.1, batch_first=True,
                                       norm_first=True)
    x = torch.randn(16, 128, 128)
    lengths = torch.arange(16) * 8 + 8  # 8 to 128 tokens
    padding = torch.arange(128)[None, :] >= lengths[:, None]
    return layer, lambda run: run(x, src_key_padding_mask=padding)


def _transformer():
    model = nn.Transformer(d_model=64, nhead=4, num_encoder_layers=1, num_decoder_layers=1,
                           dim_feedforward=128, dropout=0.1, batch_first=True)
    src, tgt = torch.randn(8, 32, 64), torch.randn(8, 24, 64)
    mask = nn.Transformer.generate_square_subsequent_mask(24)
    return model, lambda run: run(src, tgt, tgt_mask=mask, tgt_is_causal=True)


def _multihead():
    module = nn.MultiheadAttention(128, 4, dropout=0.1, batch_first=True)
    x = torch.randn(16, 128, 128)
    return module, lambda run: sum(t.square().mean() for t in run(x, x, x))  # (its defaults:
    #                                                       the weights returned too)


BLOCKS = {"TransformerEncoderLayer, dropout 0": lambda: _encoder(0.0),
          "TransformerEncoderLayer, dropout 0.1": lambda: _encoder(0.1),
          "TransformerEncoderLayer, dropout 0.1, padding masked": _padded_encoder,
          "Transformer (1 + 1 layers, causal target)": _transformer,
          "MultiheadAttention, dropout 0.1, called with its defaults": _multihead}


def measure(make, compiled: bool) -> str:
    torch.manual_seed(0)
    model, call = make()
    run = torch.compile(model) if compiled else model
    torch._dynamo.reset()
    counters.clear()
    stats = []
    for _ in range(2):
        model.zero_grad()
        with actune.compressed("L3", stats=stats.append):
            out = call(run)
        out.square().mean().backward()
    s = stats[-1]
    exact = ", ".join(f"{k} {v / MIB:.2f}" for k, v in s.exact.items()) or "nothing"
    return (f"saved {s.saved_bytes / MIB:6.2f} MiB, kept {s.kept_bytes / MIB:5.2f} MiB, "
            f"ratio {s.ratio:5.1f}x; exact (MiB): {exact}; graph breaks "
            f"{sum(counters['graph_break'].values())}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--without-multihead", action="store_true",
                        help="remove actune's rule for F.multi_head_attention_forward")
    args = parser.parse_args()
    if args.without_multihead:
        RULES.pop(F.multi_head_attention_forward)
        TRACED.pop(F.multi_head_attention_forward)
    warnings.filterwarnings("ignore", message=r"Using `torch.compile\(module\)` when")
    for title, make in BLOCKS.items():
        print(title)
        for compiled in (False, True):
            print(f"  {'compiled' if compiled else 'eager':8s} {measure(make, compiled)}",
                  flush=True)


if __name__ == "__main__":
    main()
