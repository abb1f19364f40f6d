"""A model file for a Hugging Face Llama of about 1B parameters' shape (runnable: actune
maxbatch docs/examples/hf_llama.py).

16 layers, 2,048 wide, 32 heads with 8 key-value heads (grouped-query attention), SwiGLU of
5,632, RMSNorm, rotary embeddings, vocabulary 32,000; random weights, nothing downloaded.
``model(**batch)`` with ``labels``: the model computes its own loss. ``resolution`` is the
sequence length in tokens. Needs ``transformers``: ``pip install 'actune[hf]'``.
"""

import torch

try:
    from transformers import LlamaConfig, LlamaForCausalLM
except ImportError as err:  # say which extra brings it
    raise ImportError("this model file needs Hugging Face transformers: "
                      "pip install 'actune[hf]'") from err

VOCAB = 32_000


def build_model(depth: float = 1.0, width: float = 1.0, resolution: int = 1024):
    """The model; ``depth`` scales the layers, ``width`` the width per head."""
    head_dim = max(8, round(64 * width))
    config = LlamaConfig(num_hidden_layers=max(1, round(16 * depth)), hidden_size=32 * head_dim,
                         num_attention_heads=32, num_key_value_heads=8,
                         intermediate_size=round(5632 * width), vocab_size=VOCAB,
                         max_position_embeddings=max(2048, resolution))
    return LlamaForCausalLM(config)


def make_batch(batch_size: int, resolution: int = 1024):
    """Random tokens: the inputs (keyword arguments of the model) and no separate targets."""
    ids = torch.randint(0, VOCAB, (batch_size, resolution))
    return {"input_ids": ids, "labels": ids}, None


def make_optimizer(parameters):
    return torch.optim.AdamW(parameters, lr=3e-4)
