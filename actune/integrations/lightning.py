"""A Lightning callback logging actune's figures each training step."""

from __future__ import annotations

import lightning

from actune.convert import track_stats
from actune.integrations import metrics

__all__ = ["CompressionStatsCallback"]


class CompressionStatsCallback(lightning.Callback):
    """Logs :func:`actune.integrations.metrics` of the module's compressed model (the
    LightningModule itself, or the ``attribute`` holding it) after every training batch."""

    def __init__(self, attribute: str | None = None) -> None:
        self.attribute = attribute

    def _model(self, pl_module):
        return pl_module if self.attribute is None else getattr(pl_module, self.attribute)

    def on_train_start(self, trainer, pl_module) -> None:
        track_stats(self._model(pl_module))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        model = self._model(pl_module)
        values = metrics(model)
        if values:
            pl_module.log_dict(values, on_step=True, on_epoch=False)
