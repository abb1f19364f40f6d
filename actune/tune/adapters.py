"""``--lora R``: the tuner's model with LoRA adapters on its linear layers (``peft``), its own
weights frozen: no gradient and no optimizer state for them, as a LoRA fine-tune runs.

The adapters go on every ``nn.Linear`` (and GPT-2's ``Conv1D``) but the output layer (a
Hugging Face model's output embeddings, else the last linear layer a model declares), as
peft's ``"all-linear"`` does;
rank ``R``, alpha ``2R``, no dropout. The adapters take the model's dtype (bfloat16 under
``--precision bf16-true``: peft's float32 copies of them would be a cast that fake
parameters cannot take, and their size is a rounding error beside the frozen weights').
"""

from __future__ import annotations

import contextlib
import sys
from unittest import mock

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

__all__ = ["targets", "with_lora"]


def _linear_classes() -> tuple[type[nn.Module], ...]:
    """``nn.Linear``, and Hugging Face's ``Conv1D`` (GPT-2's transposed linear layer, which
    peft adapts as one) where transformers is loaded."""
    pytorch_utils = sys.modules.get("transformers.pytorch_utils")
    conv1d = getattr(pytorch_utils, "Conv1D", None)
    return (nn.Linear,) if conv1d is None else (nn.Linear, conv1d)


def targets(model: nn.Module) -> list[str]:
    """The names of the linear layers that take adapters (see the module docstring)."""
    classes = _linear_classes()
    linear = [name for name, m in model.named_modules() if isinstance(m, classes)]
    get_output = getattr(model, "get_output_embeddings", None)
    head = get_output() if callable(get_output) else None
    if isinstance(head, nn.Linear):
        return [name for name in linear if model.get_submodule(name) is not head]
    return linear[:-1]


def with_lora(model: nn.Module, rank: int) -> nn.Module:
    """``model`` wrapped by peft with rank-``rank`` adapters, its own weights frozen. Raises
    ImportError without peft, ValueError for a model with no linear layer to adapt."""
    import peft

    names = targets(model)
    if not names:
        raise ValueError(f"{type(model).__name__} has no linear layer to put adapters on "
                         f"(besides its output layer)")
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                             target_modules=names)
    with _in_place_if_fake(model):
        return peft.get_peft_model(model, config, autocast_adapter_dtype=False)


def _in_place_if_fake(model: nn.Module) -> contextlib.AbstractContextManager:
    """In an estimate (fake parameters), a module moved to the device and dtype it has
    already stays as it is: ``Module.to`` cannot swap fake parameters (torch forces a swap
    for them), and peft moves each new adapter to its base layer's device, which it is on
    already (the model is built inside ``torch.device`` with its dtype the default)."""
    first = next(model.parameters(), None)
    if not isinstance(first, FakeTensor):
        return contextlib.nullcontext()
    move = nn.Module.to

    def to_unless_there(module: nn.Module, *args, **kwargs) -> nn.Module:
        device, dtype, *_ = torch._C._nn._parse_to(*args, **kwargs)
        if all((device is None or t.device == device)
               and (dtype is None or t.dtype == dtype or not t.is_floating_point())
               for t in (*module.parameters(), *module.buffers())):
            return module
        return move(module, *args, **kwargs)

    return mock.patch.object(nn.Module, "to", to_unless_there)
