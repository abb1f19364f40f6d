"""A Hugging Face causal LM's head and loss through
:func:`actune.chunked_loss.linear_loss.linear_cross_entropy`.

A causal LM given ``labels`` computes ``logits = self.lm_head(hidden_states)``, then
``self.loss_function(logits, labels, vocab_size, **kwargs)`` (``ForCausalLMLoss``: labels
shifted by one, ``ignore_index`` -100, ``num_items_in_batch``). :func:`chunk_loss` makes such a
model, in a training forward with ``labels`` and gradients on, skip the whole logits:

* its head returns the hidden states it was given (nothing is computed);
* its loss function receives them and calls :func:`linear_cross_entropy` with the head's
  weight and bias, the labels shifted as the model's own loss shifts them;
* the output's ``logits`` is ``None``: the logits were never whole;
* no key-value cache is built unless the call asks for one (``use_cache=True``): nothing
  reads it in training, and it holds exact copies of every layer's keys and values (72 KiB
  per token in GPT-2 small, more than all its activations at L3).

Evaluation, generation and any forward without labels or without gradients run the model's
own code. Under torch.compile the same happens inside the compiled graph (one graph, no
break: the hooks and :func:`linear_cross_entropy` trace).

Any other model's head (a linear layer with a vocabulary's outputs, in a model of one's own
or one this module does not recognise) is marked instead: in eager training it returns lazy
logits, and ``F.cross_entropy`` of them runs in chunks (:mod:`actune.substitutes.lazy_logits`; not
inside
compiled graphs, where the head computes its logits).

A model is recognised from its class's source, not from a table of families: the lines between
its head and its loss must be one of :data:`BETWEEN_HEAD_AND_LOSS`'s known forms: nothing;
Gemma's ``final_logit_softcapping``, applied in the chunks; a scale by a constant, which
commutes with a head without bias (docs/training.md counts the classes of each). A model that
does anything else there, or computes its loss otherwise, keeps its own path
(:func:`recognised` says why).
"""

from __future__ import annotations

import functools
import inspect
import re
import sys
from collections.abc import Callable

import torch
from torch import nn

from actune import tunables
from actune.chunked_loss.linear_loss import linear_cross_entropy
from actune.substitutes.lazy_logits import is_head, mark_head, unmark_head

__all__ = ["BETWEEN_HEAD_AND_LOSS", "chunk_loss", "chunks_loss", "recognised"]

_STATE = "_actune_chunked_loss"  # on the model, during a forward that chunks: its soft cap
_HANDLES = "_actune_chunk_handles"  # on the model: its hooks (present: it chunks)

#: What a model's forward may do between ``self.lm_head(...)`` and ``self.loss_function(...)``
#: (each form: the lines there, blank lines and comments left out), and what that needs:
#: ``"plain"`` nothing; ``"softcap"`` ``config.final_logit_softcapping`` applied in the chunks
#: (the model's own lines are skipped while chunking); ``"scale"`` a constant factor, which
#: the hidden states take instead of the logits (the same product without a bias).
BETWEEN_HEAD_AND_LOSS: dict[str, tuple[str, ...]] = {
    "plain": (r"loss = None", r"if labels is not None:"),
    "softcap": (r"if self\.config\.final_logit_softcapping is not None:",
                r"logits = logits(\.float\(\))? / self\.config\.final_logit_softcapping",
                r"logits = torch\.tanh\(logits\)",
                r"logits = logits \* self\.config\.final_logit_softcapping",
                r"loss = None", r"if labels is not None:"),
    "scale": (r"logits = logits (\*|/) self\.(logit_scale|config\.logits_scaling)",
              r"loss = None", r"if labels is not None:"),
}


@functools.cache
def _form_of(cls: type) -> tuple[str | None, str]:
    """The form (a key of :data:`BETWEEN_HEAD_AND_LOSS`) of ``cls``'s forward, or None and
    why not."""
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError, AttributeError):
        return None, "its forward's source is not available"
    head, loss = source.find("self.lm_head("), source.find("self.loss_function(")
    if head < 0 or loss < head:
        return None, "its forward does not call self.lm_head, then self.loss_function"
    between = source[source.find("\n", head) + 1:source.rfind("\n", 0, loss)]
    lines = [line.split("#")[0].strip() for line in between.splitlines()]
    lines = [line for line in lines if line]
    for form, patterns in BETWEEN_HEAD_AND_LOSS.items():
        if len(lines) == len(patterns) and all(
                re.fullmatch(p, line) for p, line in zip(patterns, lines, strict=True)):
            return form, ""
    return None, "its forward changes the logits between its head and its loss: " + \
        "; ".join(lines[:3])


def recognised(model: nn.Module) -> tuple[bool, str]:
    """Can :func:`chunk_loss` take ``model``'s head and loss (and if not, why not)?"""
    loss_utils = sys.modules.get("transformers.loss.loss_utils")
    if loss_utils is None or not hasattr(model, "loss_function"):
        return False, "not a Hugging Face model"
    head = getattr(model, "lm_head", None)
    if not isinstance(head, nn.Linear):
        return False, "no nn.Linear lm_head"
    if "_loss_function" in model.__dict__:
        return False, "its loss_function was set by hand"
    loss_type = getattr(model, "loss_type", None)
    mapping = loss_utils.LOSS_MAPPING
    if mapping.get(loss_type, mapping["ForCausalLM"]) is not mapping["ForCausalLM"]:
        return False, f"its loss is {loss_type}, not a causal LM's"
    form, why = _form_of(type(model))
    if form is None:
        return False, why
    if form == "scale" and head.bias is not None:
        return False, "a scaled head with a bias (the scale does not commute with it)"
    return True, form


def chunk_loss(model: nn.Module, on: bool = True) -> int:
    """Compute the loss of every recognised causal LM in ``model`` (the model itself, or the
    one a ``peft`` model wraps) in chunks, the logits never whole (see the module docstring);
    ``on=False`` restores their own path. Returns how many models it changed. Idempotent.
    :func:`actune.compress` turns it on at a compressing level."""
    changed = 0
    for module in model.modules():
        if on and _HANDLES not in module.__dict__ and recognised(module)[0]:
            _attach(module)
            changed += 1
        elif not on and _HANDLES in module.__dict__:
            _detach(module)
            changed += 1
    own = {id(m.lm_head) for m in model.modules() if _HANDLES in m.__dict__}
    vocabularies = _vocabularies(model)
    for module in model.modules():  # a plain head: F.cross_entropy(head(h), y) in chunks
        if (_plain_head(module, vocabularies) and id(module) not in own
                and is_head(module.weight) != on):
            (mark_head if on else unmark_head)(module)
            changed += 1
    return changed


def _vocabularies(model: nn.Module) -> set[int]:
    return {m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)}


def _plain_head(module: nn.Module, vocabularies: set[int]) -> bool:
    """A linear layer with as many outputs as a token embedding of the model has rows (and
    :data:`tunables.HEAD_MIN_CLASSES` or more): a language model's head, whatever the model. Not an
    MLP's projection, nor a classifier over a label set of its own."""
    return (isinstance(module, nn.Linear) and module.out_features >= tunables.HEAD_MIN_CLASSES
            and module.out_features in vocabularies)


def chunks_loss(model: nn.Module) -> bool:
    """Does ``model`` (or a model inside it) compute its loss in chunks?"""
    return any(_HANDLES in m.__dict__ or (isinstance(m, nn.Linear) and is_head(m.weight))
               for m in model.modules())


def _attach(model: nn.Module) -> None:
    mapping = sys.modules["transformers.loss.loss_utils"].LOSS_MAPPING
    own_loss = mapping["ForCausalLM"]  # (what recognised() found; read without the property,
    # which warns where a class names no loss type)
    form = _form_of(type(model))[0]
    model.loss_function = functools.partial(_loss, model, own_loss)
    model.__dict__[_HANDLES] = (
        model.register_forward_pre_hook(
            functools.partial(_arm, form, _takes_use_cache(type(model))), with_kwargs=True),
        model.register_forward_hook(_disarm, always_call=True))
    model.lm_head.forward = functools.partial(_head_forward, model, model.lm_head)


def _detach(model: nn.Module) -> None:
    for handle in model.__dict__.pop(_HANDLES):
        handle.remove()
    model.__dict__.pop("_loss_function", None)
    model.lm_head.__dict__.pop("forward", None)


@functools.cache
def _takes_use_cache(cls: type) -> bool:
    try:
        return "use_cache" in inspect.signature(cls.forward).parameters
    except (TypeError, ValueError):
        return False


def _arm(form: str, takes_use_cache: bool, model: nn.Module, args: tuple, kwargs: dict):
    if kwargs.get("labels") is None or not torch.is_grad_enabled():
        return None
    if kwargs.get("use_cache") is None and takes_use_cache:
        kwargs = {**kwargs, "use_cache": False}
    softcap = None
    config = getattr(model, "config", None)
    if form == "softcap":  # applied in the chunks; the model's own lines see None
        softcap = config.final_logit_softcapping
        config.final_logit_softcapping = None
    model.__dict__[_STATE] = (softcap, False)
    return args, kwargs


def _disarm(model: nn.Module, _args, output):
    state = model.__dict__.pop(_STATE, None)
    if state is None:
        return output
    softcap, _ = state
    if softcap is not None:
        model.config.final_logit_softcapping = softcap
    if isinstance(output, dict) and "logits" in output:
        output["logits"] = None  # (the hidden states stood in for them)
    return output


def _head_forward(model: nn.Module, head: nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
    state = model.__dict__.get(_STATE)
    if state is None:
        return type(head).forward(head, hidden)
    model.__dict__[_STATE] = (state[0], True)
    return hidden


def _loss(model: nn.Module, own: Callable, logits: torch.Tensor, labels: torch.Tensor,
          vocab_size: int | None = None, num_items_in_batch=None, ignore_index: int = -100,
          shift_labels: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
    state = model.__dict__.get(_STATE)
    head = model.lm_head
    if state is None or not state[1] or logits.shape[-1] != head.in_features:
        return own(logits, labels, vocab_size, num_items_in_batch=num_items_in_batch,
                   ignore_index=ignore_index, shift_labels=shift_labels, **kwargs)
    if shift_labels is None:  # as ForCausalLMLoss: tokens < n predict n
        labels = nn.functional.pad(labels, (0, 1), value=ignore_index)
        shift_labels = labels[..., 1:]
    target = shift_labels.to(logits.device)
    if num_items_in_batch is None:
        return linear_cross_entropy(logits, head.weight, target, head.bias,
                                    ignore_index=ignore_index, softcap=state[0])
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(logits.device)
    return linear_cross_entropy(logits, head.weight, target, head.bias,
                                ignore_index=ignore_index, reduction="sum",
                                softcap=state[0], divide_by=num_items_in_batch)
