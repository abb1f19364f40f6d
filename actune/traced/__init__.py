"""Compressed saved activations inside ``torch.compile`` graphs (docs/training.md).

While Dynamo traces, :func:`actune.compressed` and :func:`actune.compress` route calls through
:mod:`actune.traced.rules`: autograd functions written in torch ops that pack in forward and
unpack in backward, so the compiled graphs hold the packed bytes between them.
"""

from actune.traced.pack import Packed, pack, packed_bytes, unpack
from actune.traced.rules import TRACED, TracedMode, dispatch

__all__ = ["TRACED", "Packed", "TracedMode", "dispatch", "pack", "packed_bytes", "unpack"]
