"""A model file for Hugging Face GPT-2 (runnable: actune maxbatch docs/examples/hf_gpt2.py).

GPT-2 small as ``GPT2Config()`` defines it (12 layers, 768 wide, 12 heads, vocabulary 50,257)
with random weights: nothing is downloaded. The batch is what a Hugging Face training loop
passes, ``model(**batch)`` with ``labels``, so the model computes its own loss; actune reads it
from the output. ``resolution`` is the sequence length in tokens. Needs ``transformers``:
``pip install 'actune[hf]'``.
"""

import torch

try:
    from transformers import GPT2Config, GPT2LMHeadModel
except ImportError as err:  # say which extra brings it
    raise ImportError("this model file needs Hugging Face transformers: "
                      "pip install 'actune[hf]'") from err

HEADS = 12


def build_model(depth: float = 1.0, width: float = 1.0, resolution: int = 512):
    """GPT-2 small; ``depth`` scales the layers, ``width`` the width per head."""
    config = GPT2Config(n_layer=max(1, round(12 * depth)), n_head=HEADS,
                        n_embd=HEADS * max(8, round(64 * width)),
                        n_positions=max(1024, resolution))
    return GPT2LMHeadModel(config)


def make_batch(batch_size: int, resolution: int = 512):
    """Random tokens: the inputs (keyword arguments of the model) and no separate targets."""
    ids = torch.randint(0, GPT2Config().vocab_size, (batch_size, resolution))
    return {"input_ids": ids, "labels": ids}, None


def make_optimizer(parameters):
    return torch.optim.AdamW(parameters, lr=3e-4)
