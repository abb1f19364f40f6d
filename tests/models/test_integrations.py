"""Where users train: Hugging Face Trainer, Accelerate and Lightning around a compressed model.
A few CPU steps each on a tiny GPT-2 memorising 16 sequences: the loss falls as it does
uncompressed, and the callbacks report the saved activations compressed."""

from __future__ import annotations

import pytest
import torch

import actune
from actune.integrations import metrics

transformers = pytest.importorskip("transformers")


def _model(level: str = "L3"):
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=64,
                                     n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0)
    return actune.compress(transformers.GPT2LMHeadModel(config), level)


def _sequences() -> torch.Tensor:
    return torch.randint(0, 64, (16, 64), generator=torch.Generator().manual_seed(1))


class _Dataset(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.ids = _sequences()

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def test_trainer_trains_and_logs_compression(tmp_path):
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from actune.integrations.hf import log_compression

    seen: list[dict] = []

    class Record(TrainerCallback):  # a reporter after ours: what the console would print
        def on_log(self, args, state, control, logs=None, **kwargs):
            seen.append(dict(logs or {}))

    args = TrainingArguments(output_dir=str(tmp_path), max_steps=30, learning_rate=1e-2,
                             per_device_train_batch_size=8, logging_steps=10, report_to=[],
                             use_cpu=True, save_strategy="no", disable_tqdm=True, seed=0)
    trainer = Trainer(model=_model(), args=args, train_dataset=_Dataset(), callbacks=[Record()])
    log_compression(trainer)
    trainer.train()
    losses = [r["loss"] for r in seen if "loss" in r]
    assert losses[-1] < 0.85 * losses[0]
    assert all(r["actune/compression"] > 4 for r in seen if "loss" in r)


@pytest.fixture
def _accelerate_state_restored(monkeypatch):
    """``torch_compile=True`` sets ``ACCELERATE_DYNAMO_BACKEND`` in the environment and the
    Trainer's Accelerator state (a process-wide singleton) keeps its dynamo backend: a later
    ``Accelerator()`` in the same process would compile its model. Both are undone."""
    from accelerate.state import AcceleratorState

    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "NO")  # (restored: unset, at teardown)
    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


@pytest.mark.usefixtures("_accelerate_state_restored")
def test_trainer_compiling_the_model_logs_compression_too(tmp_path):
    """``torch_compile=True``: the compiled steps run none of actune's hooks; the callback's
    trainer computes its losses under ``count_compiled``, which records the graphs' saves."""
    from torch._dynamo.utils import counters
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from actune.integrations.hf import log_compression

    seen: list[dict] = []

    class Record(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            seen.append(dict(logs or {}))

    args = TrainingArguments(output_dir=str(tmp_path), max_steps=30, learning_rate=1e-2,
                             per_device_train_batch_size=8, logging_steps=10, report_to=[],
                             use_cpu=True, save_strategy="no", disable_tqdm=True, seed=0,
                             torch_compile=True, torch_compile_backend="aot_eager")
    trainer = Trainer(model=_model(), args=args, train_dataset=_Dataset(), callbacks=[Record()])
    log_compression(trainer)
    torch._dynamo.reset()
    counters.clear()
    trainer.train()
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    losses = [r["loss"] for r in seen if "loss" in r]
    assert losses[-1] < 0.85 * losses[0]
    assert all(r["actune/compression"] > 4 for r in seen if "loss" in r)


def _accelerated(level: str):
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = actune.track_stats(_model(level))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = accelerator.prepare(model, opt)
    ids = _sequences()
    losses = []
    torch.manual_seed(0)
    for step in range(30):
        batch = ids[(step % 2) * 8:(step % 2) * 8 + 8]
        loss = model(input_ids=batch, labels=batch).loss
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return accelerator.unwrap_model(model), losses


def test_accelerate_prepare_trains_compressed_like_uncompressed():
    model, losses = _accelerated("L3")
    _, exact = _accelerated("L0")
    assert losses[-1] < 0.85 * losses[0]
    assert losses[-1] < 1.1 * exact[-1]
    assert metrics(model)["actune/compression"] > 4


@pytest.mark.parametrize("compiled", [False, True])
def test_lightning_module_with_a_compressed_model(compiled):
    """Compiled (the held model through ``torch.compile``), the callback counts each batch's
    compiled forward under ``count_compiled``: the same figures are logged."""
    import lightning
    from torch._dynamo.utils import counters

    from actune.integrations.lightning import CompressionStatsCallback

    class Module(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = torch.compile(_model(), backend="aot_eager") if compiled else _model()
            self.losses: list[float] = []

        def training_step(self, batch, _index):
            loss = self.model(input_ids=batch, labels=batch).loss
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    module = Module()
    trainer = lightning.Trainer(max_steps=30, accelerator="cpu", logger=False,
                                enable_checkpointing=False, enable_progress_bar=False,
                                enable_model_summary=False,
                                callbacks=[CompressionStatsCallback("model")])
    loader = torch.utils.data.DataLoader(_sequences(), batch_size=8)
    torch._dynamo.reset()
    counters.clear()
    trainer.fit(module, loader)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    # (compiled, a mixed level packs at its uniform widths, 2 bits: this 30-step recipe's
    # last loss spreads widely with the rounding's seed, eager too; the loss still falls)
    assert module.losses[-1] < (0.95 if compiled else 0.85) * module.losses[0]
    assert trainer.callback_metrics["actune/compression"] > 4
