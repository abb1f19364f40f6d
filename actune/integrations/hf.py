"""A Hugging Face ``Trainer`` callback adding actune's figures to every log."""

from __future__ import annotations

from transformers import Trainer, TrainerCallback

from actune.convert import track_stats
from actune.integrations import metrics

__all__ = ["CompressionStatsCallback", "log_compression"]


class CompressionStatsCallback(TrainerCallback):
    """Adds :func:`actune.integrations.metrics` of the trained model to each log, so the
    reporters after it (console, TensorBoard, W&B...) show them."""

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is not None:
            track_stats(model)

    def on_log(self, args, state, control, logs=None, model=None, **kwargs):
        if logs is not None and model is not None:
            logs.update(metrics(model))


def log_compression(trainer: Trainer) -> Trainer:
    """Put a :class:`CompressionStatsCallback` first among ``trainer``'s callbacks (the
    reporters read the log after it); returns the trainer."""
    trainer.callback_handler.callbacks.insert(0, CompressionStatsCallback())
    return trainer
