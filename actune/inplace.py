"""Which batch norms may write their result over their input: found from a graph of the model.

A batch norm right after a convolution holds three activation-sized tensors at once in
forward: the convolution's output, its own output, and whatever the model keeps alive beside
them (a residual block's shortcut). Under :func:`actune.compressed` it packs its input first,
so it can write its result over that input, but only where nothing else reads the input
afterwards. Eager code cannot tell (a model may keep the output in a local, a list, a hook);
a graph of ``forward`` can: :func:`allow_inplace_norms` traces the model with ``torch.fx``,
finds each convolution whose output's only reader is a batch norm, and tags that output at
run time (a forward hook) so the norm may overwrite it. A model torch.fx cannot trace keeps
PyTorch's own batch norm; nothing else changes.
"""

from __future__ import annotations

import warnings
from collections import Counter

import torch
from torch import fx, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.conv import _ConvNd

from actune.session.hooks import allow_overwrite

__all__ = ["allow_inplace_norms", "disallow_inplace_norms"]

_HANDLE_ATTR = "_actune_inplace_handle"
_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def _from_torch(cls: type) -> bool:
    return cls.__module__.startswith(("torch.nn", "torch.ao.nn"))


class _Tracer(fx.Tracer):
    """torch.fx's tracer, which also keeps a compressed counterpart of a torch.nn layer (a
    subclass made by :func:`actune.compress`) as one call. A user's own subclass of a layer
    is traced through, as torch.fx does: its ``forward`` may keep what it returns."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if isinstance(m, _CONTAINERS):
            return False
        cls = type(m)
        counterpart = cls.__module__ == "actune.convert" and _from_torch(cls.__mro__[1])
        return _from_torch(cls) or counterpart


def _tag(_module: nn.Module, _args, output):
    if isinstance(output, torch.Tensor) and not torch.compiler.is_compiling():
        allow_overwrite(output)


def _pairs(model: nn.Module) -> list[tuple[str, str]]:
    """(convolution, batch norm) names where the norm is the only reader of the convolution's
    output, each called once in ``forward``; empty if the model cannot be traced."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            graph = _Tracer().trace(model)
    except Exception:  # any failure to trace means: no graph, nothing overwritten
        return []
    modules = dict(model.named_modules())
    calls = Counter(n.target for n in graph.nodes if n.op == "call_module")
    pairs = []
    for node in graph.nodes:
        if node.op != "call_module" or not isinstance(modules.get(node.target), _BatchNorm):
            continue
        src = node.args[0] if len(node.args) == 1 and not node.kwargs else None
        if (isinstance(src, fx.Node) and src.op == "call_module"
                and isinstance(modules.get(src.target), _ConvNd)
                and calls[src.target] == 1 and len(src.users) == 1):
            pairs.append((src.target, node.target))
    return pairs


def allow_inplace_norms(model: nn.Module) -> list[str]:
    """Let each batch norm that is the only reader of a convolution's output write its result
    over that output when it runs under :func:`actune.compressed` in training mode (it packs
    the output first); returns those norms' names. Tracing runs ``forward`` once on symbolic
    values (torch.fx); a model that cannot be traced gets an empty list and is unchanged.
    :func:`actune.compress` calls this; call it yourself when you use ``compressed()``
    directly. Calling it again is harmless."""
    disallow_inplace_norms(model)  # the graph may have changed since a previous call
    norms = []
    for conv_name, norm_name in _pairs(model):
        conv = model.get_submodule(conv_name)
        if _HANDLE_ATTR not in conv.__dict__:
            conv.__dict__[_HANDLE_ATTR] = conv.register_forward_hook(_tag)
        norms.append(norm_name)
    return norms


def disallow_inplace_norms(model: nn.Module) -> None:
    """Undo :func:`allow_inplace_norms`: every batch norm of ``model`` keeps its input."""
    for module in model.modules():
        handle = module.__dict__.pop(_HANDLE_ATTR, None)
        if handle is not None:
            handle.remove()
