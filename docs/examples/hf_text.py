"""A model file with real text: a byte-level Hugging Face GPT-2 on Python's own documentation.

``pydoc_data.topics`` ships with every Python (about 465 KB of English about Python); its
bytes are the tokens (vocabulary 256), in sequences of ``resolution`` bytes, the last tenth
held out. ``make_dataset`` serves ``actune numerics`` (gradient bias and variance per layer
against SGD's own noise, on this text) and ``actune train``-style loops; ``make_batch`` serves
the tuner. The model is called with the token tensor alone (``model(ids)``), so ``loss_fn``
computes the next-byte loss from its logits. Needs ``pip install 'actune[hf]'``.

    actune numerics docs/examples/hf_text.py --levels L2,L3 --batch 16
"""

from pydoc_data.topics import topics

import torch
import torch.nn.functional as F  # noqa: N812

try:
    from transformers import GPT2Config, GPT2LMHeadModel
except ImportError as err:  # say which extra brings it
    raise ImportError("this model file needs Hugging Face transformers: "
                      "pip install 'actune[hf]'") from err


def build_model(depth: float = 1.0, width: float = 1.0, resolution: int = 64):
    config = GPT2Config(vocab_size=256, n_positions=max(128, resolution),
                        n_layer=max(1, round(2 * depth)), n_embd=4 * max(8, round(32 * width)),
                        n_head=4, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def _text() -> torch.Tensor:
    text = "\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8")
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).long()


def make_dataset(resolution: int = 64):
    """(x_train, y_train, x_test, y_test): byte sequences; the targets are the inputs (the
    loss shifts them by one)."""
    data = _text()
    rows = data[: len(data) // resolution * resolution].view(-1, resolution)
    cut = int(0.9 * len(rows))
    return rows[:cut], rows[:cut], rows[cut:], rows[cut:]


def make_batch(batch_size: int, resolution: int = 64):
    rows = make_dataset(resolution)[0]
    ids = rows[torch.randint(0, len(rows), (batch_size,))]
    return ids, ids


def loss_fn(outputs, targets):
    """Next-byte cross entropy from the logits of a ``CausalLMOutput``."""
    logits = outputs.logits[:, :-1]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets[:, 1:].reshape(-1))


def make_optimizer(parameters):
    return torch.optim.AdamW(parameters, lr=2e-3)
