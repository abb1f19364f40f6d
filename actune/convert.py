"""compress(model, level): turn a model's layers into compressed counterparts, in place.

A compressed counterpart is a subclass of the layer's own class whose ``forward`` runs the
original ``forward`` inside :func:`actune.compressed` at the model's level. Converting swaps
``module.__class__`` only: weights, buffers, running statistics, ``requires_grad`` flags, hooks,
train/eval mode, device and dtype are the very same objects, so ``state_dict()`` keys and
checkpoints are unchanged both ways. Pooling by average is never substituted (ActNN replaced
AvgPool with MaxPool): under the model's level it keeps nothing at all. Other modules are left
as they are, with the reason in :func:`summary`.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from actune.autoprec.allocator import AutoPrecision
from actune.chunked_loss.lm_head import chunk_loss
from actune.families import default_level
from actune.inplace import allow_inplace_norms, disallow_inplace_norms
from actune.levels import Level, get_level
from actune.packing.kernels import COMPILE
from actune.session.hooks import active_level, compressed, shared_cache
from actune.substitutes.fused import FUSED, class_name, fused_of
from actune.traced import TracedMode, dispatch, traced

__all__ = ["ConversionRow", "autoprec_of", "compress", "count_compiled", "decompress",
           "is_compressed", "stats_of", "summary", "track_stats"]

_LEVEL_ATTR = "_actune_level"
_AUTOPREC_ATTR = "_actune_autoprec"
_ROOT_LEVEL_ATTR = "_actune_root_level"
_STATS_ATTR = "_actune_stats"
_TRACK_ATTR = "_actune_track_stats"
_LOSS_TYPE_ATTR = "_actune_loss_type"  # (a Hugging Face model's own, before compress)

# Layer classes with a compressed counterpart, and what the counterpart keeps for backward.
_SUPPORTED: dict[type[nn.Module], str] = {
    **{cls: "packed input (matmul bits)" for cls in (
        nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d,
        nn.ConvTranspose3d, nn.Linear)},
    **{cls: "packed input (other bits)" for cls in (
        nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm, nn.LayerNorm,
        nn.GroupNorm)},
    nn.ReLU: "its output packed once, zeros exact (shared with the next layer; exact mask)",
    **{cls: "1-bit mask" for cls in (nn.ReLU6, nn.LeakyReLU, nn.Hardtanh)},
    **{cls: "packed derivative (other bits)" for cls in (nn.GELU, nn.SiLU, nn.Sigmoid, nn.Tanh,
                                                         nn.Hardswish, nn.Mish)},
    nn.Hardsigmoid: "1-bit mask",
    nn.Softmax: "two packed copies of the output (other bits)",
    nn.MaxPool2d: "argmax offset in its window (1 byte)",
    nn.MaxPool3d: "argmax offset in its window (1 byte)",
    **{cls: "1-bit mask" for cls in (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d)},
    nn.Embedding: "indices only (nothing large)",
}
_KEPT_EXACT: dict[type[nn.Module], str] = {
    **{cls: "keeps nothing under compressed(): backward needs only the input's shape (never "
            "substituted by max pooling)" for cls in (
        nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d, nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d,
        nn.AdaptiveAvgPool3d)},
    **{cls: "saves nothing" for cls in (nn.Flatten, nn.Identity)},
    nn.MaxPool1d: "1-d max pooling keeps PyTorch's own indices",
}


_COUNTERPARTS: dict[type[nn.Module], type[nn.Module]] = {}


def _inside_own_level(module: nn.Module) -> bool:
    """Eager, and already inside a :func:`compressed` block at the module's own level (the
    model's forward, which a converted model runs under its level): a block of its own would
    change nothing, and entering one costs about as much as a small layer's packing."""
    # (is_dynamo_compiling first: Dynamo reads it as a constant and guards on nothing; the
    # compile session's flag, read outside Dynamo only, is one attribute read, no call)
    return (not (torch.compiler.is_dynamo_compiling() or COMPILE._is_compiling_flag)
            and active_level() is module.__dict__.get(_LEVEL_ATTR))


def _compressed_forward(self, *args, **kwargs):
    if _inside_own_level(self):
        return super(type(self), self).forward(*args, **kwargs)
    if traced():  # traced rules: packs inside the compiled graphs
        with TracedMode(getattr(self, _LEVEL_ATTR)):
            return super(type(self), self).forward(*args, **kwargs)
    return _eager_forward(self, *args, **kwargs)


#: Activations whose function Dynamo calls without the active torch function mode
#: (``torch.overrides`` lists them as ignored): compiled, their counterpart calls the traced
#: rule itself.
_UNROUTED_WHEN_COMPILED = {nn.Hardswish: F.hardswish, nn.Hardsigmoid: F.hardsigmoid}


def _unrouted_forward(self, x):
    if traced():
        return dispatch(getattr(self, _LEVEL_ATTR), _UNROUTED_WHEN_COMPILED[_base_class(self)],
                        (x, self.inplace), {})
    return _compressed_forward(self, x)


def _fused_forward(self, x, *args, **kwargs):
    if args or kwargs or not isinstance(x, torch.Tensor):
        return _compressed_forward(self, x, *args, **kwargs)
    if _inside_own_level(self):
        return _fused_or_own(self, x)
    if traced():
        with TracedMode(getattr(self, _LEVEL_ATTR)):
            return _fused_or_own(self, x)
    return _eager_fused_forward(self, x)


def _fused_or_own(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The one op standing in for ``module``'s inline chain, or its own forward where the op
    does not fit (under whichever block the caller opened)."""
    out = fused_of(_base_class(module))(module, x)
    return super(type(module), module).forward(x) if out is None else out


@torch.compiler.disable(recursive=True)
def _eager_forward(self, *args, **kwargs):
    with compressed(getattr(self, _LEVEL_ATTR)):
        return super(type(self), self).forward(*args, **kwargs)


@torch.compiler.disable(recursive=True)
def _eager_fused_forward(self, x):
    with compressed(getattr(self, _LEVEL_ATTR)):
        return _fused_or_own(self, x)


def _counterpart(cls: type[nn.Module]) -> type[nn.Module]:
    made = _COUNTERPARTS.get(cls)
    if made is None:
        name = f"Compressed{cls.__name__}"
        forward = (_unrouted_forward if cls in _UNROUTED_WHEN_COMPILED
                   else _compressed_forward if fused_of(cls) is None else _fused_forward)
        made = type(name, (cls,), {"forward": forward, "__module__": __name__,
                                   "__doc__": f"{cls.__name__} with compressed activations."})
        globals()[name] = made  # importable by name, so compressed models pickle
        _COUNTERPARTS[cls] = made
    return made


for _cls in _SUPPORTED:
    _counterpart(_cls)


@dataclass(frozen=True)
class ConversionRow:
    """One module of a conversion summary."""

    name: str
    layer: str
    converted: bool
    keeps: str

    def as_dict(self) -> dict:
        return asdict(self)


def _base_class(module: nn.Module) -> type[nn.Module]:
    cls = type(module)
    return cls.__mro__[1] if cls in _COUNTERPARTS.values() else cls


def _supported(cls: type[nn.Module]) -> str | None:
    """What the counterpart of ``cls`` (or of its nearest supported ancestor) keeps."""
    for ancestor in cls.__mro__:
        if ancestor in _SUPPORTED:
            return _SUPPORTED[ancestor]
        if class_name(ancestor) in FUSED:
            return FUSED[class_name(ancestor)].keeps
    return None


class _RootForward:
    """A converted model's ``forward`` (an attribute of the instance): its own forward, under
    the traced rules at the model's level while Dynamo traces it (uniform widths, no
    allocator), so that the functional calls between its layers (attention, inline
    activations, the loss a model computes itself) follow the same rules in a compiled
    graph. Entered here, in the frame Dynamo compiles, not in the forward pre-hook: Dynamo
    compiles a hook as a frame of its own and replays its mode push at run time, so the
    compiled forward would then run every op of its run-time code through the Python mode
    (docs/benchmarks.md, "Host work"). Eager calls run the forward as it is (the hooks open
    the level). Pickles and deep-copies with its model."""

    def __init__(self, module: nn.Module, inner=None) -> None:
        self.module = module
        self.inner = inner  # an instance forward of the model's own, if it had one

    def __call__(self, *args, **kwargs):
        module = self.module
        if traced():
            with TracedMode(module.__dict__[_ROOT_LEVEL_ATTR]):
                return self._forward(*args, **kwargs)
        return self._forward(*args, **kwargs)

    def _forward(self, *args, **kwargs):
        if self.inner is not None:
            return self.inner(*args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)

    @property
    def __signature__(self) -> inspect.Signature:
        # (the model's own: Hugging Face's Trainer keeps the dataset columns it names)
        own = self.inner if self.inner is not None else \
            type(self.module).forward.__get__(self.module)
        return inspect.signature(own)


def _wrap_forward(model: nn.Module) -> None:
    if not isinstance(model.__dict__.get("forward"), _RootForward) and \
            type(model) not in _COUNTERPARTS.values():  # (a layer enters the rules itself)
        model.forward = _RootForward(model, model.__dict__.get("forward"))


def _unwrap_forward(model: nn.Module) -> None:
    wrapper = model.__dict__.get("forward")
    if isinstance(wrapper, _RootForward):
        del model.forward
        if wrapper.inner is not None:
            model.forward = wrapper.inner


def _enter_forward(module, _args):
    # the whole forward runs under the model's level: the functional calls between layers
    # (attention, inline activations, the loss a model computes itself) follow the same rules
    if traced():  # (compiled: the traced rules, entered by _RootForward)
        return
    ap = module.__dict__.get(_AUTOPREC_ATTR) if module.training else None
    stack = contextlib.ExitStack()
    stack.enter_context(shared_cache(ap))
    stats = functools.partial(_remember_stats, module) if module.__dict__.get(
        _TRACK_ATTR) else None  # (accounting costs a little on every saved tensor: opt-in)
    stack.enter_context(compressed(module.__dict__[_ROOT_LEVEL_ATTR], stats=stats))
    module._actune_cache = stack


def _remember_stats(module: nn.Module, stats) -> None:
    if module.training:
        module.__dict__[_STATS_ATTR] = stats


def track_stats(model: nn.Module, on: bool = True) -> nn.Module:
    """Record the :class:`~actune.CompressionStats` of each training forward of ``model`` (a
    model converted by :func:`compress`) for :func:`stats_of`; returns the model. The
    callbacks of :mod:`actune.integrations` turn it on when training starts."""
    model.__dict__[_TRACK_ATTR] = on
    return model


def stats_of(model: nn.Module):
    """The :class:`~actune.CompressionStats` of ``model``'s last forward pass in training mode
    since :func:`track_stats` (None before one): what its saved tensors would have taken and
    what was kept."""
    return model.__dict__.get(_STATS_ATTR)


def count_compiled(model: nn.Module) -> contextlib.AbstractContextManager:
    """Around a compiled step of ``model`` (converted by :func:`compress`, with
    :func:`track_stats` on): record what its compiled graphs save for :func:`stats_of`. A
    compiled forward runs none of actune's hooks, so this opens :func:`compressed` at the
    model's level, whose accounting sees the graphs' saved tensors (packed codes and what
    the partitioner kept). Around an eager step it would count the step twice: use it only
    where the model runs compiled. A no-op for a model not tracked."""
    level = model.__dict__.get(_ROOT_LEVEL_ATTR)
    if level is None or not model.__dict__.get(_TRACK_ATTR) or not model.training:
        return contextlib.nullcontext()
    return compressed(level, stats=functools.partial(_remember_stats, model))


def _exit_forward(module, _args, _output):
    stack = module.__dict__.pop("_actune_cache", None)
    if stack is not None:
        stack.close()


def is_compressed(module: nn.Module) -> bool:
    """True if ``module`` (or any submodule) was converted by :func:`compress`."""
    return any(hasattr(m, _LEVEL_ATTR) for m in module.modules())


def compress(model: nn.Module, level: str | Level | None = None, *, every: int = 50,
             per_sample: bool = True, inplace: bool = True) -> nn.Module:
    """Convert ``model``'s supported layers in place to compressed counterparts; returns it.

    ``level`` None: :func:`actune.default_level` of the model (L3; L2 for a model with GELU
    activations, whose kind was measured short of the targets at L3; L3 again for a model
    fine-tuned through adapters).
    Works before or after ``.to(device)``; converting again just sets the new level;
    :func:`decompress` restores plain layers. The model's whole forward runs under
    :func:`actune.compressed` at that level, so functional calls between the layers (attention,
    inline activations, a loss the model computes itself, as Hugging Face models do with
    ``labels``) follow the same rules; a loss computed outside the model is not covered: wrap
    it in :func:`actune.compressed` too. A mixed-precision level (L3-L5, ``"2b"``, ``"1.25b"``)
    attaches an :class:`~actune.autoprec.allocator.AutoPrecision` (see :func:`autoprec_of`); each
    forward pass in training mode is one step of it, ``every`` steps between allocations,
    ``per_sample`` bits per sample too. A Hugging Face causal LM trained with ``labels``
    computes its head and loss in chunks, the logits never whole (:func:`actune.chunk_loss`;
    ``outputs.logits`` is then None in training). ``inplace``: batch norms that are the only
    reader of a convolution's output write their result over it (:func:`allow_inplace_norms`).
    """
    lv = default_level(model) if level is None else get_level(level)
    if lv.exact:
        return decompress(model)
    ap = model.__dict__.get(_AUTOPREC_ATTR)
    if lv.avg_bits is None:
        model.__dict__.pop(_AUTOPREC_ATTR, None)
    elif ap is None or ap.avg_bits != lv.avg_bits:
        model.__dict__[_AUTOPREC_ATTR] = AutoPrecision(lv.avg_bits, every=every,
                                                       per_sample=per_sample)
    else:
        ap.every, ap.per_sample = every, per_sample
    for module in model.modules():
        base = _base_class(module)
        if _supported(base) is None:
            continue
        module.__class__ = _counterpart(base)
        setattr(module, _LEVEL_ATTR, lv)
    model.__dict__[_ROOT_LEVEL_ATTR] = lv
    _name_hf_loss(model)
    chunk_loss(model)  # (a causal LM's logits never whole: the largest tensors left)
    if not hasattr(model, "_actune_handles"):
        model._actune_handles = (model.register_forward_pre_hook(_enter_forward),
                                 model.register_forward_hook(_exit_forward, always_call=True))
    _wrap_forward(model)
    if inplace:
        allow_inplace_norms(model)
    else:
        disallow_inplace_norms(model)
    return model


def _name_hf_loss(model: nn.Module) -> None:
    """Name the loss a Hugging Face model falls back to where its class name names none
    (``GPT2LMHeadModel``): its forward otherwise logs a warning on every call, a graph break
    under torch.compile between the logits and the loss, at any level. The same loss
    (``ForCausalLM``, what ``loss_function`` falls back to), no warning; :func:`decompress`
    puts the model's own value back."""
    loss_utils = sys.modules.get("transformers.loss.loss_utils")
    if loss_utils is None:
        return
    for module in model.modules():
        own = module.__dict__.get("loss_type", "")
        if own != "" and own not in loss_utils.LOSS_MAPPING and \
                _LOSS_TYPE_ATTR not in module.__dict__:
            module.__dict__[_LOSS_TYPE_ATTR] = own
            module.loss_type = "ForCausalLM"


def _restore(module: nn.Module) -> None:
    if hasattr(module, _LEVEL_ATTR):
        module.__class__ = _base_class(module)
        delattr(module, _LEVEL_ATTR)
    if _LOSS_TYPE_ATTR in module.__dict__:
        module.loss_type = module.__dict__.pop(_LOSS_TYPE_ATTR)


def decompress(model: nn.Module) -> nn.Module:
    """Undo :func:`compress` in place; returns ``model``."""
    chunk_loss(model, on=False)
    for module in model.modules():
        _restore(module)
    for handle in model.__dict__.pop("_actune_handles", ()):
        handle.remove()
    _unwrap_forward(model)
    model.__dict__.pop(_AUTOPREC_ATTR, None)
    model.__dict__.pop(_ROOT_LEVEL_ATTR, None)
    disallow_inplace_norms(model)
    return model


def autoprec_of(model: nn.Module) -> AutoPrecision | None:
    """The bit allocator :func:`compress` attached to ``model`` (mixed-precision levels)."""
    return model.__dict__.get(_AUTOPREC_ATTR)


def summary(model: nn.Module) -> list[ConversionRow]:
    """What each leaf module is and keeps for backward: converted or left as is, and why."""
    rows = []
    root = model.__dict__.get(_ROOT_LEVEL_ATTR)
    for name, module in model.named_modules():
        if next(module.children(), None) is not None:
            continue  # containers: their leaves are listed
        base = _base_class(module)
        converted = hasattr(module, _LEVEL_ATTR)
        if converted:
            keeps = f"{_supported(base)} at {getattr(module, _LEVEL_ATTR).name}"
        elif _supported(base) is not None:
            keeps = "not converted (compress() was not called on it, or level L0)"
        elif base in _KEPT_EXACT:
            keeps = _KEPT_EXACT[base]
        elif root is not None:
            keeps = (f"no counterpart: its calls follow actune's rules at {root.name} (the "
                     f"model's whole forward runs under its level)")
        else:
            keeps = ("left as is: no compressed counterpart; actune.compressed() covers its "
                     "functional calls")
        rows.append(ConversionRow(name or "(model)", base.__name__, converted, keeps))
    return rows


