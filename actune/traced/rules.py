"""Which function runs through which traced autograd function, and at which level's bits.

:func:`dispatch` is what :func:`actune.compressed`'s function mode (and :class:`TracedMode`)
does while Dynamo traces: one table lookup per call, then a handler that returns the op's
output, or ``None`` where it keeps PyTorch's own op (a small tensor, an exact width, an
operand it does not cover). Handlers read the level only: no session, no allocator.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F  # noqa: N812
from torch.overrides import TorchFunctionMode

from actune.levels import Level
from actune.packing.codebooks import gelu_codebook
from actune.substitutes.functions import arg, one_class_per_row, reduced_count
from actune.substitutes.grid_sample import grid_sample_call
from actune.substitutes.multihead import decompose
from actune.traced.attention import PackedAttention, PackedCrossEntropy, RedrawnDropout
from actune.traced.convolutions import MaskedReLU, PackedBatchNorm, PackedConv
from actune.traced.functions import (
    BroadcastProduct,
    DerivativeCodes,
    GatedProduct,
    PackedDerivative,
    PackedGridSample,
    PackedLinear,
    PackedNorm,
    PackedProduct,
    PackedVectorNorm,
    TwoCopyNormalize,
    TwoSlopes,
    carry_copy,
    shared_copy,
    softmax_sharing_copy,
)

__all__ = ["TRACED", "TracedMode", "dispatch"]

Handler = Callable[[Level, tuple, dict], torch.Tensor | None]
#: function -> handler (see the module docstring)
TRACED: dict[Callable, Handler] = {}


def _register(*funcs: Callable) -> Callable[[Handler], Handler]:
    def add(handler: Handler) -> Handler:
        for f in funcs:
            TRACED[f] = handler
        return handler
    return add


def _activation(t, level: Level) -> bool:
    """A floating tensor large enough, computed in the graph or given to it (a batch), not a
    leaf that records gradients (a weight)."""
    return (isinstance(t, torch.Tensor) and t.is_floating_point()
            and not (t.is_leaf and t.requires_grad) and t.numel() >= level.min_numel)


def _input_width(level: Level, x: torch.Tensor, features_out: int) -> int:
    """A layer's input's bits: :attr:`Level.narrow_width` where the layer widens it (an
    adapter's B matrix), else ``matmul_bits``."""
    if level.widens(x.shape[-1], features_out):
        return level.narrow_width
    return level.matmul_bits


@_register(F.linear)
def _linear(level, args, kwargs):
    x, w, b = args[0], arg(args, kwargs, 1, "weight", None), arg(args, kwargs, 2, "bias", None)
    if (level.matmul_bits is None or not _activation(x, level) or not isinstance(w, torch.Tensor)
            or not w.requires_grad):  # (a frozen weight: PyTorch's own op keeps no input)
        return None
    return PackedLinear.apply(x, w, b, _input_width(level, x, w.shape[0]), level.group_size)


@_register(torch.addmm, torch.Tensor.addmm)
def _addmm(level, args, kwargs):
    """``addmm(bias, x, w)`` with a weight ``w`` (Hugging Face's Conv1D): a linear layer."""
    if len(args) != 3 or kwargs:
        return None
    b, x, w = args
    if (level.matmul_bits is None or not _activation(x, level) or not isinstance(w, torch.Tensor)
            or not w.is_leaf or not w.requires_grad or b.dim() != 1):
        return None
    return PackedLinear.apply(x, w.t(), b, _input_width(level, x, w.shape[-1]),
                              level.group_size)


@_register(torch.linalg.vector_norm)
def _vector_norm(level, args, kwargs):
    """A 2-norm over some dims (ConvNeXt V2's global response norm), no dtype or out."""
    x = args[0]
    order = arg(args, kwargs, 1, "ord", 2)
    dim = arg(args, kwargs, 2, "dim", None)
    if (level.other_bits is None or not _activation(x, level) or isinstance(order, bool)
            or order != 2 or kwargs.get("dtype") is not None or kwargs.get("out") is not None
            or not (dim is None or isinstance(dim, int | tuple | list))):
        return None
    dim = dim if dim is None or isinstance(dim, int) else tuple(dim)
    if reduced_count(x, dim) < 2:
        return None
    return PackedVectorNorm.apply(x, dim, bool(arg(args, kwargs, 3, "keepdim", False)),
                                  level.other_bits, level.group_size)


@_register(F.normalize)
def _normalize(level, args, kwargs):
    x = args[0]
    p = arg(args, kwargs, 1, "p", 2.0)
    dim = arg(args, kwargs, 2, "dim", 1)
    eps = arg(args, kwargs, 3, "eps", 1e-12)
    if (level.other_bits is None or not _activation(x, level) or isinstance(p, bool) or p != 2
            or arg(args, kwargs, 4, "out", None) is not None or not isinstance(dim, int)
            or isinstance(eps, bool) or not isinstance(eps, int | float)):
        return None
    return TwoCopyNormalize.apply(x, dim, float(eps), level.sensitive_width, level.group_size)


@_register(F.grid_sample)
def _grid_sample(level, args, kwargs):
    call = grid_sample_call(args, kwargs)
    if (call is None or level.sensitive_width is None
            or not _activation(call.x, level)):
        return None
    return PackedGridSample.apply(*call, level.sensitive_width, level.group_size)


@_register(torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm,
           torch.Tensor.bmm)
def _matmul(level, args, kwargs):
    if len(args) != 2 or kwargs:
        return None
    a, b = args
    if level.matmul_bits is None or not (isinstance(a, torch.Tensor)
                                         and isinstance(b, torch.Tensor)):
        return None
    if b.is_leaf and b.dim() == 2 and _activation(a, level):  # x @ weight
        if not b.requires_grad:  # frozen: PyTorch's own op keeps no input
            return None
        return PackedLinear.apply(a, b.t(), None, _input_width(level, a, b.shape[-1]),
                                  level.group_size)
    if (_activation(a, level) and _activation(b, level) and a.dim() == b.dim() >= 3
            and a.shape[:-2] == b.shape[:-2]):
        return PackedProduct.apply(a, b, level.matmul_bits, level.group_size,
                                   *shared_copy(a, level.matmul_bits, level.group_size))
    return None


def _derivative(name: str) -> Handler:
    def handler(level, args, kwargs):
        x = args[0]
        if level.other_bits is None or not _activation(x, level):
            return None
        if name == "gelu":
            approximate = arg(args, kwargs, 1, "approximate", "none")
            if level.derivative_codes is not None:
                return DerivativeCodes.apply(x, "gelu_tanh" if approximate == "tanh" else name,
                                             gelu_codebook(approximate, level.derivative_codes),
                                             level.group_size)
            if approximate == "tanh":
                return PackedDerivative.apply(x, "gelu_tanh", level.other_bits,
                                              level.group_size)
        if name == "silu" and arg(args, kwargs, 1, "inplace", False):
            return None
        return PackedDerivative.apply(x, name, level.other_bits, level.group_size)
    return handler


_register(F.gelu)(_derivative("gelu"))
_register(F.silu)(_derivative("silu"))


def _in_place(x: torch.Tensor, out: torch.Tensor | None, inplace: bool):
    """``out`` written over ``x`` for an in-place call (``Hardswish(inplace=True)``), as the
    ReLU rule does; None stays None (PyTorch's own op)."""
    return x.copy_(out) if inplace and out is not None else out


@_register(F.hardswish)
def _hardswish(level, args, kwargs):
    out = _derivative("hardswish")(level, args[:1], {})
    return _in_place(args[0], out, arg(args, kwargs, 1, "inplace", False))


@_register(F.mish)
def _mish(level, args, kwargs):
    out = _derivative("mish")(level, args[:1], {})
    return _in_place(args[0], out, arg(args, kwargs, 1, "inplace", False))


def _smooth(name: str, defaults: tuple = (), inplace_at: int | None = None) -> Handler:
    """The derivative rule of an activation with parameters, at their defaults only
    (``defaults``: ``(position, keyword, value)`` each; other values: PyTorch's own)."""
    def handler(level, args, kwargs):
        if any(arg(args, kwargs, i, key, value) != value for i, key, value in defaults):
            return None
        inplace = inplace_at is not None and arg(args, kwargs, inplace_at, "inplace", False)
        out = _derivative(name)(level, args[:1], {})
        return _in_place(args[0], out, inplace)
    return handler


_register(F.elu)(_smooth("elu", ((1, "alpha", 1.0),), 2))
_register(F.celu)(_smooth("elu", ((1, "alpha", 1.0),), 2))  # (CELU at alpha 1 is ELU)
_register(F.selu)(_smooth("selu", (), 1))
_register(F.softplus)(_smooth("softplus", ((1, "beta", 1.0), (2, "threshold", 20.0))))
_register(F.logsigmoid)(_smooth("logsigmoid"))
_register(F.softsign)(_smooth("softsign"))
_register(F.tanhshrink)(_smooth("tanhshrink"))


def _two_slopes(level, x, inplace, name: str, a: float, b: float):
    if not level.masks or not _activation(x, level):
        return None
    return _in_place(x, TwoSlopes.apply(x, name, float(a), float(b)), inplace)


@_register(F.hardtanh)
def _hardtanh(level, args, kwargs):
    return _two_slopes(level, args[0], arg(args, kwargs, 3, "inplace", False), "hardtanh",
                       arg(args, kwargs, 1, "min_val", -1.0), arg(args, kwargs, 2, "max_val", 1.0))


@_register(F.relu6)
def _relu6(level, args, kwargs):
    return _two_slopes(level, args[0], arg(args, kwargs, 1, "inplace", False), "hardtanh", 0.0,
                       6.0)


@_register(F.hardsigmoid)
def _hardsigmoid(level, args, kwargs):
    return _two_slopes(level, args[0], arg(args, kwargs, 1, "inplace", False), "hardsigmoid",
                       0.0, 0.0)


@_register(F.leaky_relu)
def _leaky_relu(level, args, kwargs):
    return _two_slopes(level, args[0], arg(args, kwargs, 2, "inplace", False), "leaky_relu",
                       arg(args, kwargs, 1, "negative_slope", 0.01), 0.0)


def _norm(rms: bool) -> Handler:
    def handler(level, args, kwargs):
        x = args[0]
        shape = arg(args, kwargs, 1, "normalized_shape", None)
        weight = arg(args, kwargs, 2, "weight", None)
        bias = None if rms else arg(args, kwargs, 3, "bias", None)
        eps = arg(args, kwargs, 3 if rms else 4, "eps", None if rms else 1e-5)
        if level.other_bits is None or not _activation(x, level) or shape is None:
            return None
        if eps is None:
            eps = torch.finfo(x.dtype).eps
        dims = 1 if isinstance(shape, int) else len(shape)
        return PackedNorm.apply(x, weight, bias, dims, float(eps), rms, level.other_bits,
                                level.group_size)
    return handler


_register(F.layer_norm, torch.layer_norm)(_norm(False))
_register(F.rms_norm, torch.rms_norm)(_norm(True))


@_register(F.softmax, torch.softmax, torch.Tensor.softmax)
def _softmax(level, args, kwargs):
    x = args[0]
    dim = arg(args, kwargs, 1, "dim", None)
    if (level.other_bits is None or not _activation(x, level) or dim is None
            or arg(args, kwargs, 3 if len(args) > 3 else 2, "dtype", None) is not None):
        return None
    return softmax_sharing_copy(x, dim, level.other_bits, level.group_size)


@_register(F.dropout)
def _dropout(level, args, kwargs):
    """In training, the mask drawn again in backward from a key (nothing kept for it); a
    dropout that drops nothing (``p == 0``, or not training: a model's attention dropout set
    to 0) passes a softmax's packed copy on to the product that reads its output. In place:
    PyTorch's own."""
    x, p = args[0], arg(args, kwargs, 1, "p", 0.5)
    training = arg(args, kwargs, 2, "training", True)
    if p == 0 or not training:
        return carry_copy(x, F.dropout(*args, **kwargs))
    if (arg(args, kwargs, 3, "inplace", False) or not 0 < p < 1
            or not _activation(x, level)):
        return None
    return RedrawnDropout.apply(x, float(p))


@_register(torch.mul, torch.Tensor.mul, torch.Tensor.__mul__, torch.Tensor.__rmul__)
def _mul(level, args, kwargs):
    """Two activations of one shape; a product with a broadcast operand (rotary tables, a
    mask) saves only that small operand and runs as it is, unless that operand needs a
    gradient (a squeeze-excitation gate): the large one is then kept rounded."""
    a, b = args[0], arg(args, kwargs, 1, "other", None)
    broadcast = _broadcast_product(level, args, kwargs, a, b)
    if broadcast is not None:
        return broadcast
    if (level.sensitive_width is None or len(args) + len(kwargs) != 2
            or not (_activation(a, level) and _activation(b, level))
            or a.shape != b.shape or a.dtype != b.dtype or not (a.requires_grad
                                                                and b.requires_grad)):
        return None
    return GatedProduct.apply(a, b, level.sensitive_width, level.group_size)


def _broadcast_product(level, args, kwargs, a, b):
    if (level.other_bits is None or len(args) + len(kwargs) != 2
            or not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor))
            or a.shape == b.shape or a.dtype != b.dtype):
        return None
    big, small = (a, b) if a.numel() > b.numel() else (b, a)
    if (not small.requires_grad or not _activation(big, level) or big.dim() != small.dim()
            or torch.broadcast_shapes(big.shape, small.shape) != big.shape):
        return None
    return BroadcastProduct.apply(big, small, level.other_bits, level.group_size)


@_register(F.scaled_dot_product_attention)
def _attention(level, args, kwargs):
    q, k, v = args[:3]
    mask = arg(args, kwargs, 3, "attn_mask", None)
    dropout = arg(args, kwargs, 4, "dropout_p", 0.0)
    causal = bool(arg(args, kwargs, 5, "is_causal", False))
    scale = arg(args, kwargs, 6, "scale", None)
    if (level.nonlinear_bits is None or level.sensitive_width is None
            or not all(_activation(t, level) for t in (q, k, v))
            or (mask is not None and (not isinstance(mask, torch.Tensor) or mask.requires_grad))
            or q.dim() != 4 or q.shape[-3] % k.shape[-3]):
        return None
    return PackedAttention.apply(q, k, v, mask, causal, scale, level.nonlinear_bits,
                                 level.sensitive_width, level.group_size, float(dropout))


@_register(F.multi_head_attention_forward)
def _multihead(level, args, kwargs):
    """``nn.MultiheadAttention``'s usual path as its calls, each routed by a mode entered
    again (:mod:`actune.substitutes.multihead`); None elsewhere: PyTorch's own code."""
    with TracedMode(level):
        return decompose(args, kwargs)


@_register(F.cross_entropy)
def _cross_entropy(level, args, kwargs):
    x, target = args[0], arg(args, kwargs, 1, "target", None)
    extra = {n: kwargs.get(n) for n in ("weight", "size_average", "reduce")}
    reduction = arg(args, kwargs, 6, "reduction", "mean")
    if (len(args) > 2 or any(v is not None for v in extra.values())
            or arg(args, kwargs, 7, "label_smoothing", 0.0) or level.sensitive_width is None
            or not _activation(x, level) or not isinstance(target, torch.Tensor)
            or target.is_floating_point() or not one_class_per_row(x, target)
            or reduction not in ("mean", "sum")):
        return None
    if x.dim() > 2:  # (N, C, d1, ...): rows of classes, as the eager rule takes them
        x, target = x.movedim(1, -1).reshape(-1, x.shape[1]), target.reshape(-1)
    return PackedCrossEntropy.apply(x, target, int(kwargs.get("ignore_index", -100)), reduction,
                                    level.sensitive_width, level.group_size)


def _conv(dims: int) -> Handler:
    def handler(level, args, kwargs):
        x, w = args[0], arg(args, kwargs, 1, "weight", None)
        b = arg(args, kwargs, 2, "bias", None)
        conf = [arg(args, kwargs, 3 + i, name, default) for i, (name, default) in
                enumerate((("stride", 1), ("padding", 0), ("dilation", 1), ("groups", 1)))]
        if (level.matmul_bits is None or not _activation(x, level) or isinstance(conf[1], str)
                or not isinstance(w, torch.Tensor)):
            return None
        stride, padding, dilation = (
            [int(v)] * dims if isinstance(v, int) else [int(e) for e in v] for v in conf[:3])
        return PackedConv.apply(x, w, b, stride, padding, dilation, int(conf[3]),
                                level.matmul_bits, level.group_size)
    return handler


_register(F.conv1d)(_conv(1))
_register(F.conv2d)(_conv(2))
_register(F.conv3d)(_conv(3))


@_register(F.relu, torch.relu, torch.Tensor.relu)
def _relu(level, args, kwargs):
    x = args[0]
    if not level.masks or not _activation(x, level) or len(args) > 2:
        return None
    out = MaskedReLU.apply(x)
    # in place (``nn.ReLU(inplace=True)``): the result written over the input, as PyTorch's
    # op does; left to PyTorch, it saves its output whole, and Inductor once gave that
    # output's mask a layout its backward did not expect (ResNet-18 at 64 x 64)
    return x.copy_(out) if arg(args, kwargs, 1, "inplace", False) else out


@_register(F.relu_, torch.relu_, torch.Tensor.relu_)
def _relu_inplace(level, args, kwargs):
    out = _relu(level, args[:1], {})
    return None if out is None else args[0].copy_(out)


@_register(F.batch_norm)
def _batch_norm(level, args, kwargs):
    x = args[0]
    mean = arg(args, kwargs, 1, "running_mean", None)
    var = arg(args, kwargs, 2, "running_var", None)
    weight, bias = arg(args, kwargs, 3, "weight", None), arg(args, kwargs, 4, "bias", None)
    training = arg(args, kwargs, 5, "training", False)
    momentum = arg(args, kwargs, 6, "momentum", 0.1)
    eps = arg(args, kwargs, 7, "eps", 1e-5)
    if (level.other_bits is None or not training or not _activation(x, level) or x.dim() < 2
            or momentum is None):
        return None
    y, batch_mean, batch_var = PackedBatchNorm.apply(x, weight, bias, float(eps),
                                                     level.other_bits, level.group_size)
    if mean is not None and var is not None:  # the running statistics, as PyTorch's
        n = x.numel() // x.shape[1]
        with torch.no_grad():
            mean.mul_(1 - momentum).add_(batch_mean.to(mean.dtype), alpha=momentum)
            var.mul_(1 - momentum).add_((batch_var * (n / max(n - 1, 1))).to(var.dtype),
                                        alpha=momentum)
    return y


def dispatch(level: Level, func: Callable, args: tuple, kwargs: dict):
    """Run ``func`` through its traced rule at ``level``, or as it is."""
    handler = TRACED.get(func)
    if handler is not None and torch.is_grad_enabled():
        out = handler(level, args, kwargs)
        if out is not None:
            return out
    return func(*args, **kwargs)


class TracedMode(TorchFunctionMode):
    """Routes calls through :data:`TRACED` at ``level``: what a compressed model's forward runs
    under while Dynamo traces it (see :func:`actune.compress`)."""

    def __init__(self, level: Level) -> None:
        super().__init__()
        self.level = level

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return dispatch(self.level, func, args, kwargs or {})
