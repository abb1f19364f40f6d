"""A Lightning callback logging actune's figures each training step."""

from __future__ import annotations

import contextlib

import lightning

from actune.convert import count_compiled, track_stats
from actune.integrations import metrics

__all__ = ["CompressionStatsCallback"]


class CompressionStatsCallback(lightning.Callback):
    """Logs :func:`actune.integrations.metrics` of the module's compressed model (the
    LightningModule itself, or the ``attribute`` holding it) after every training batch.
    Where that model is compiled (``torch.compile`` of it, or of the LightningModule), each
    batch's forward runs under :func:`actune.count_compiled`, since a compiled step runs none
    of actune's hooks to record its figures."""

    def __init__(self, attribute: str | None = None) -> None:
        self.attribute = attribute
        self._counting = contextlib.ExitStack()

    def _held(self, pl_module):
        return pl_module if self.attribute is None else getattr(pl_module, self.attribute)

    def _model(self, pl_module):
        held = self._held(pl_module)
        return getattr(held, "_orig_mod", held)  # (the model a torch.compile wrapper holds)

    def _compiled(self, pl_module) -> bool:
        return (self._held(pl_module) is not self._model(pl_module)
                or getattr(pl_module, "_compiler_ctx", None) is not None)

    def on_train_start(self, trainer, pl_module) -> None:
        track_stats(self._model(pl_module))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._compiled(pl_module):
            self._counting.enter_context(count_compiled(self._model(pl_module)))

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        self._counting.close()  # (the forward's saved tensors are counted: record them)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._counting.close()  # (a batch that ran no backward)
        values = metrics(self._model(pl_module))
        if values:
            pl_module.log_dict(values, on_step=True, on_epoch=False)
