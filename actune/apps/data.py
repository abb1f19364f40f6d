"""Real data that ships offline: scikit-learn's handwritten digits (1797 8x8 images).

scikit-learn is an optional extra (``pip install "actune[data]"``); nothing is downloaded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F  # noqa: N812

__all__ = ["Dataset", "digits"]


@dataclass(frozen=True)
class Dataset:
    """Inputs and integer targets, split into train and test."""

    name: str
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor

    def __post_init__(self) -> None:
        for split, x, y in (("train", self.x_train, self.y_train),
                            ("test", self.x_test, self.y_test)):
            if len(x) != len(y) or len(x) == 0:
                raise ValueError(f"dataset {self.name!r}: the {split} split has {len(x)} inputs "
                                 f"and {len(y)} targets; both must be equal and non-zero")

    def batch_indices(self, batch_size: int, generator: torch.Generator) -> list[torch.Tensor]:
        """Indices into the training split, shuffled, in batches (the last may be smaller)."""
        return list(torch.randperm(len(self.x_train), generator=generator).split(batch_size))

    def batches(self, batch_size: int, generator: torch.Generator) -> list[tuple]:
        """The training split in shuffled batches (the last one may be smaller)."""
        return [(self.x_train[i], self.y_train[i])
                for i in self.batch_indices(batch_size, generator)]


def digits(resolution: int = 8, channels: int = 1, test_fraction: float = 0.2) -> Dataset:
    """scikit-learn's digits scaled to [0, 1] and standardised, as ``channels`` x
    ``resolution`` x ``resolution`` images (bilinear resizing above 8), with a fixed
    stratified split (every 5th image of each class is a test image by default)."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:  # pragma: no cover - depends on the installation
        raise ImportError("the digits dataset needs scikit-learn: pip install "
                          "\"actune[data]\" (or pip install scikit-learn)") from None
    raw = load_digits()
    x = torch.tensor(raw.data, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0
    y = torch.tensor(raw.target, dtype=torch.int64)
    x = (x - x.mean()) / x.std()
    if resolution != 8:
        x = F.interpolate(x, size=(resolution, resolution), mode="bilinear",
                          align_corners=False)
    if channels != 1:
        x = x.expand(-1, channels, -1, -1).contiguous()
    every = max(2, round(1 / test_fraction))
    test = torch.zeros(len(y), dtype=torch.bool)
    for c in range(10):
        idx = torch.nonzero(y == c).flatten()
        test[idx[::every]] = True
    return Dataset("digits", x[~test], y[~test], x[test], y[test])
