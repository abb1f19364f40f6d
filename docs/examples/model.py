"""An example model file for actune (runnable: actune maxbatch docs/examples/model.py).

A small CNN for 3-channel images whose depth, width and input resolution can all be scaled.
"""

import torch
from torch import nn


def build_model(depth: float = 1.0, width: float = 1.0, resolution: int = 32) -> nn.Module:
    """The model at a size: ``depth`` multiplies the blocks, ``width`` the channels."""
    channels = max(8, round(32 * width))
    blocks = max(1, round(3 * depth))
    layers: list[nn.Module] = [nn.Conv2d(3, channels, 3, padding=1, bias=False),
                               nn.BatchNorm2d(channels), nn.ReLU(inplace=True)]
    for _ in range(blocks):
        layers += [nn.Conv2d(channels, channels, 3, padding=1, bias=False),
                   nn.BatchNorm2d(channels), nn.ReLU(inplace=True)]
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, 10)]
    return nn.Sequential(*layers)


def make_batch(batch_size: int, resolution: int = 32):
    """A random batch: (inputs, targets)."""
    inputs = torch.randn(batch_size, 3, resolution, resolution)
    targets = torch.randint(0, 10, (batch_size,))
    return inputs, targets


# Optional; these are the defaults actune uses when they are missing.
def loss_fn(outputs, targets):
    return nn.functional.cross_entropy(outputs, targets)


def make_optimizer(parameters):
    return torch.optim.SGD(parameters, lr=0.01, momentum=0.9)
