"""Where users train: a Hugging Face ``Trainer`` callback and a Lightning callback that log
what :func:`actune.compress` saves (docs/integrations.md). Each imports its library when its
module is imported; :func:`metrics` needs neither."""

from __future__ import annotations

from torch import nn

from actune.convert import stats_of

__all__ = ["metrics"]


def metrics(model: nn.Module) -> dict[str, float]:
    """The last training forward's saved-activation figures of a compressed ``model``
    (empty before one): MiB autograd would have kept, MiB kept, and their ratio."""
    stats = stats_of(model)
    if stats is None or not stats.saved_bytes:
        return {}
    return {"actune/saved_mib": stats.saved_bytes / 2**20,
            "actune/kept_mib": stats.kept_bytes / 2**20,
            "actune/compression": stats.ratio}
