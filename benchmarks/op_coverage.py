"""PyTorch's own ops one at a time under compressed(): what each keeps, and what stays exact.

Each op of a user's model or loss that the sweeps of whole models may miss (recurrent layers,
norms, resampling, reductions, sorting, distances, regression, classification and CTC losses,
pointwise ops of two tensors, pooling) runs on one input of a few hundred KiB that needs a
gradient, in a step under ``compressed(level)`` (L3 by default): the ratio of the bytes
autograd would keep to the bytes kept, and what stayed exact, by op. An op with a ratio of
1.0x keeps everything exact: no rule covers it (or, as for a divisor, by design).

    python benchmarks/op_coverage.py [--level L3] [--ops instance_norm,std]
"""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F  # noqa: N812
from rich.console import Console
from rich.table import Table
from torch import nn

import actune

_GEN = torch.Generator().manual_seed(0)
IMAGES = torch.randn(8, 16, 32, 32, generator=_GEN)  # 512 KiB
TOKENS = torch.randn(8, 64, 128, generator=_GEN)  # 256 KiB
ROWS = torch.randn(256, 128, generator=_GEN)  # 128 KiB
TARGET = torch.randn(256, 128, generator=_GEN)
PIXEL_CLASSES = torch.randint(0, 16, (8, 32, 32), generator=_GEN)
GRID = torch.rand(8, 16, 16, 2, generator=_GEN) * 2 - 1
CTC_TARGETS = torch.randint(1, 128, (8, 27), generator=_GEN)
CTC_LENGTHS = torch.arange(20, 28)


def _modules() -> dict[str, nn.Module]:
    torch.manual_seed(0)
    return {"lstm": nn.LSTM(128, 128, batch_first=True),
            "gru": nn.GRU(128, 128, batch_first=True),
            "group_norm": nn.GroupNorm(4, 16), "instance_norm": nn.InstanceNorm2d(16, affine=True),
            "depthwise_conv": nn.Conv2d(16, 16, 3, padding=1, groups=16),
            "prelu": nn.PReLU(16)}


def ops() -> dict[str, tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]]:
    """name -> (input, the op of it)."""
    m = _modules()

    def hand_norm(t: torch.Tensor) -> torch.Tensor:  # (The Annotated Transformer's)
        return (t - t.mean(-1, keepdim=True)) / (t.std(-1, keepdim=True) + 1e-6)

    return {
        "LSTM": (TOKENS, lambda t: m["lstm"](t)[0]),
        "GRU": (TOKENS, lambda t: m["gru"](t)[0]),
        "GroupNorm": (IMAGES, m["group_norm"]),
        "InstanceNorm2d": (IMAGES, m["instance_norm"]),
        "depthwise conv": (IMAGES, m["depthwise_conv"]),
        "PReLU": (IMAGES, m["prelu"]),
        "layer norm written by hand (x.std)": (TOKENS, hand_norm),
        "std": (ROWS, lambda t: t.std(-1)),
        "var_mean": (ROWS, lambda t: torch.var_mean(t, -1)[0]),
        "logsumexp": (ROWS, lambda t: torch.logsumexp(t, -1)),
        "cumsum": (ROWS, lambda t: torch.cumsum(t, -1).square()),
        "topk": (ROWS, lambda t: torch.topk(t, 8, -1).values),
        "sort": (ROWS, lambda t: torch.sort(t, -1).values.square()),
        "maximum": (ROWS, lambda t: torch.maximum(t, TARGET)),
        "max along a dim (values and indices)": (ROWS, lambda t: t.max(-1).values),
        "amax (a stable softmax's shift)": (ROWS, lambda t: t - t.amax(-1, keepdim=True)),
        "cummax": (ROWS, lambda t: torch.cummax(t, -1).values),
        "division by an activation": (ROWS, lambda t: t / (t.abs() + 1)),
        "division by a row's statistic": (ROWS, lambda t: t / t.square().sum(-1, keepdim=True)),
        "cosine_similarity": (ROWS, lambda t: F.cosine_similarity(t, TARGET)),
        # (a contrastive loss's similarity matrix: every row against every row, broadcast)
        "cosine_similarity matrix": (ROWS[:128], lambda t: F.cosine_similarity(
            t[:, None], t[None], dim=-1)),
        "cdist": (ROWS, lambda t: torch.cdist(t[:128], t[128:])),
        "grid_sample": (IMAGES, lambda t: F.grid_sample(t, GRID, align_corners=False)),
        # (a grid computed from the input, as a spatial transformer's or deformable
        # attention's offsets are: its gradient reads the input)
        "grid_sample of a learned grid": (IMAGES, lambda t: F.grid_sample(
            t, GRID + 0.1 * torch.tanh(F.adaptive_avg_pool2d(t[:, :2], 16).permute(0, 2, 3, 1)),
            align_corners=False)),
        "pixel_shuffle": (IMAGES, lambda t: F.pixel_shuffle(t, 2).square()),
        "unfold": (IMAGES, lambda t: F.unfold(t, 3, padding=1).square()),
        "interpolate (bilinear)": (IMAGES, lambda t: F.interpolate(
            t, scale_factor=2, mode="bilinear").square()),
        "max_pool2d": (IMAGES, lambda t: F.max_pool2d(t, 2)),
        "adaptive_max_pool2d": (IMAGES, lambda t: F.adaptive_max_pool2d(t, 4)),
        "mse_loss": (ROWS, lambda t: F.mse_loss(t, TARGET)),
        "l1_loss": (ROWS, lambda t: F.l1_loss(t, TARGET)),
        "smooth_l1_loss": (ROWS, lambda t: F.smooth_l1_loss(t, TARGET)),
        "binary_cross_entropy_with_logits": (ROWS, lambda t: F.binary_cross_entropy_with_logits(
            t, (TARGET > 0).float())),
        "kl_div of log_softmax": (ROWS, lambda t: F.kl_div(
            F.log_softmax(t, -1), F.softmax(TARGET, -1), reduction="batchmean")),
        "cross_entropy, per pixel": (IMAGES, lambda t: F.cross_entropy(t, PIXEL_CLASSES)),
        "nll_loss of log_softmax, per pixel": (IMAGES, lambda t: F.nll_loss(
            F.log_softmax(t, 1), PIXEL_CLASSES)),
        # (speech recognition's: 64 frames of 128 classes, 8 targets of 20 to 27 labels)
        "ctc_loss of log_softmax": (TOKENS, lambda t: F.ctc_loss(
            F.log_softmax(t.transpose(0, 1), -1), CTC_TARGETS, torch.full((8,), 64),
            CTC_LENGTHS)),
    }


def measure(x: torch.Tensor, fn, level: str) -> actune.CompressionStats:
    x = x.clone().requires_grad_()
    found: list[actune.CompressionStats] = []
    with actune.compressed(level, stats=found.append):
        y = fn(x * 1.0)  # (a non-leaf input, as inside a model)
    (y.float().square().mean() if y.dim() else y).backward()
    return found[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--level", default="L3")
    parser.add_argument("--ops", default="", help="comma-separated names (default: all)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    table = Table(title=f"{args.level}, one op a step")
    for column in ("op", "saved KiB", "kept KiB", "ratio", "kept exact"):
        table.add_column(column, justify="left" if column in ("op", "kept exact") else "right")
    wanted = {n.strip() for n in args.ops.split(",") if n.strip()}
    for name, (x, fn) in ops().items():
        if wanted and name not in wanted:
            continue
        s = measure(x, fn, args.level)
        table.add_row(name, f"{s.saved_bytes / 1024:.0f}", f"{s.kept_bytes / 1024:.0f}",
                      f"{s.ratio:.1f}x", s.describe_exact() if s.exact else "nothing")
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
