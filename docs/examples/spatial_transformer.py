"""A spatial transformer classifier (runnable:
actune maxbatch docs/examples/spatial_transformer.py).

A small localisation network predicts an affine warp of each image (``F.affine_grid``, then
``F.grid_sample``); a convolutional body reads the warped image, and the head pools its
features two ways, a global max (``F.adaptive_max_pool2d``) and the mean of each channel's
four largest values (``topk``), keeping the larger (``torch.maximum``). Ops of a user's own
forward that PyTorch's layers do not cover: each keeps what it saves compressed.
"""

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn


class SpatialTransformer(nn.Module):
    def __init__(self, width: float = 1.0) -> None:
        super().__init__()
        channels = max(8, round(32 * width))
        self.locate = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(),
                                    nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(128, 6))
        nn.init.zeros_(self.locate[-1].weight)  # (the identity warp to start from)
        with torch.no_grad():
            self.locate[-1].bias.copy_(torch.tensor([1.0, 0, 0, 0, 1, 0]))
        self.body = nn.Sequential(nn.Conv2d(3, channels, 3, padding=1), nn.ReLU(),
                                  nn.Conv2d(channels, channels, 3, padding=1))
        self.head = nn.Linear(channels, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        theta = self.locate(x).view(-1, 2, 3)
        grid = F.affine_grid(theta, list(x.shape), align_corners=False)
        h = self.body(F.grid_sample(x, grid, align_corners=False))
        peak = F.adaptive_max_pool2d(h, 1).flatten(1)
        top = h.flatten(2).topk(4, dim=-1).values.mean(-1)
        return self.head(torch.maximum(peak, top))


def build_model(width: float = 1.0, resolution: int = 32) -> nn.Module:
    return SpatialTransformer(width)


def make_batch(batch_size: int, resolution: int = 32):
    return (torch.randn(batch_size, 3, resolution, resolution),
            torch.randint(0, 10, (batch_size,)))
