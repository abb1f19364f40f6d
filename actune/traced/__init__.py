"""Compressed saved activations inside ``torch.compile`` graphs (docs/training.md).

While Dynamo traces, :func:`actune.compressed` and :func:`actune.compress` route calls through
:mod:`actune.traced.rules`: autograd functions written in torch ops that pack in forward and
unpack in backward, so the compiled graphs hold the packed bytes between them.
"""

import warnings

import torch

from actune.traced.pack import Packed, group_statistic, pack, packed_bytes, packed_origin, unpack
from actune.traced.rules import TRACED, TracedMode, dispatch

__all__ = ["TRACEABLE", "TRACED", "Packed", "TracedMode", "dispatch", "group_statistic", "pack",
           "packed_bytes", "packed_origin", "traced", "unpack"]

#: Does this torch's Dynamo trace function modes and autograd functions into one graph (2.6
#: and later; 2.13 is what the tests run)? Older ones run compressed layers eagerly.
TRACEABLE = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 6)
_warned: list = []


def traced() -> bool:
    """True while Dynamo traces and the traced rules apply. On a torch too old for them,
    warns once and returns False: the caller runs its eager path (a graph break)."""
    if not torch.compiler.is_compiling():
        return False
    if TRACEABLE:
        return True
    if not _warned:
        _warned.append(True)
        warnings.warn(f"actune: torch {torch.__version__} cannot trace compressed layers into "
                      "a compiled graph (torch 2.6 or later can): they run eagerly, with a "
                      "graph break at each, and the compiled step's peak is not reduced",
                      stacklevel=3)
    return False
