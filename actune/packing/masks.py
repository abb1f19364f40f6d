"""Boolean tensors at one bit per element (exact)."""

from __future__ import annotations

import numpy as np
import torch

from actune.packing.formats import PackedMask
from actune.packing.kernels import plain

__all__ = ["pack_mask", "unpack_mask"]


def pack_mask(mask: torch.Tensor) -> PackedMask:
    """Pack a boolean tensor into 1 bit per element."""
    flat = mask.detach().reshape(-1)
    if flat.device.type == "cpu" and plain(flat):  # NumPy's packbits: one pass, same layout
        return PackedMask(torch.from_numpy(np.packbits(flat.numpy(), bitorder="little")),
                          mask.shape)
    pad = (-flat.numel()) % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=flat.device)
    bits8 = (flat.view(-1, 8).to(torch.uint8) * weights).sum(dim=1, dtype=torch.uint8)
    return PackedMask(bits8, mask.shape)


def unpack_mask(p: PackedMask) -> torch.Tensor:
    """The boolean tensor ``p`` was packed from."""
    n = 1
    for d in p.shape:
        n *= d
    if p.bits8.device.type == "cpu" and plain(p.bits8):
        bits = np.unpackbits(p.bits8.numpy(), count=n, bitorder="little")
        return torch.from_numpy(bits.view(np.bool_)).view(p.shape)
    shifts = torch.arange(8, dtype=torch.uint8, device=p.bits8.device)
    bits = ((p.bits8.unsqueeze(1) >> shifts) & 1).view(-1)[:n]
    return bits.view(p.shape).bool()

