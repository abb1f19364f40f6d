"""A Hugging Face ``Trainer`` callback adding actune's figures to every log."""

from __future__ import annotations

import functools

from transformers import Trainer, TrainerCallback

from actune.convert import count_compiled, track_stats
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
    reporters read the log after it); returns the trainer. With ``torch_compile=True`` its
    training losses are computed under :func:`actune.count_compiled` (a compiled step runs
    none of actune's hooks to record them otherwise)."""
    trainer.callback_handler.callbacks.insert(0, CompressionStatsCallback())
    if trainer.args.torch_compile:
        compute = trainer.compute_loss

        @functools.wraps(compute)
        def compute_loss(model, inputs, *args, **kwargs):
            with count_compiled(trainer.model):
                return compute(model, inputs, *args, **kwargs)
        trainer.compute_loss = compute_loss
    return trainer
