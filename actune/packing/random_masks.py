"""Dropout keep masks drawn again from a seed: backward regenerates the forward's mask
instead of keeping it.

On the CPU the mask comes from the packed format's counter-based random stream
(:mod:`actune_kernels.cpu_masks`): about 0.6 ns an element on two threads, against 7-8 ns
for ``torch.bernoulli_`` (docs/benchmarks.md), and nothing to keep between the passes.
Elsewhere (CUDA, traced code) callers keep PyTorch's own dropout.
"""

from __future__ import annotations

import functools

import torch
from torch._subclasses.fake_tensor import FakeTensor

from actune.packing.kernels import compiling

__all__ = ["drawn_here", "keep_mask"]


@functools.cache
def _kernels():
    from actune_kernels import cpu_masks

    return cpu_masks


def drawn_here(x: torch.Tensor) -> bool:
    """Can :func:`keep_mask` draw ``x``'s mask: a CPU tensor (a fake one included: an
    estimate), outside traced code?"""
    return x.device.type == "cpu" and not compiling() and (
        type(x) is torch.Tensor or isinstance(x, FakeTensor))


def keep_mask(shape: torch.Size, keep: float, seed: int, like: torch.Tensor) -> torch.Tensor:
    """A contiguous bool tensor of ``shape`` on ``like``'s device: True with probability
    ``keep``, element ``i`` (in row-major order) a pure function of ``seed`` and ``i``. For a
    fake ``like`` (an estimate) only the storage exists."""
    out = like.new_empty(shape, dtype=torch.bool)
    if type(out) is torch.Tensor and out.numel():
        _kernels().keep_mask_at(out.data_ptr(), out.numel(), seed, keep)
    return out
