"""Pooling: max pooling keeps each output's argmax as a one-byte offset in its window (exact),
not int64 input indices and not its input. Average pooling saves nothing large (no rule)."""

from __future__ import annotations

import math

import torch.nn.functional as F  # noqa: N812

from actune.rules import register
from actune.substitutes import OffsetMaxPool, arg, as_tuple

_DIMS = {F.max_pool2d: 2, F.max_pool3d: 3}  # 1-d keeps PyTorch's own (exact) indices


@register(tuple(_DIMS), "pooling", None, "argmax offset in its window (1 byte, exact)")
def max_pool(s, func, args, kwargs, level):
    x = args[0]
    dims = _DIMS[func]
    if (not level.masks or x.dim() < dims + 1
            or arg(args, kwargs, 6, "return_indices", False)):
        return None
    kernel = as_tuple(arg(args, kwargs, 1, "kernel_size", None), dims)
    stride = as_tuple(arg(args, kwargs, 2, "stride", None) or kernel, dims)
    padding = as_tuple(arg(args, kwargs, 3, "padding", 0), dims)
    dilation = as_tuple(arg(args, kwargs, 4, "dilation", 1), dims)
    ceil_mode = bool(arg(args, kwargs, 5, "ceil_mode", False))
    if math.prod(kernel) > 256:
        return None
    return OffsetMaxPool.apply(x, dims, kernel, stride, padding, dilation, ceil_mode, s)
