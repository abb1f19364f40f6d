"""Matmuls: linear layers, convolutions, matmul / mm / bmm / addmm / baddbmm / einsum, and the
grouped matmuls of mixture-of-experts layers.

What they save is their inputs (the weight gradient reads the activation, the input gradient
the weight). Both backward products are linear in each saved tensor, so the activation is kept
stochastically rounded at the level's ``matmul_bits``: the gradient stays unbiased. Parameters
stay references. Large plain convolutions run :class:`~actune.substitutes.functions.OrderedConv`,
whose
backward holds one activation-sized tensor at a time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812

from actune.rules.registry import register
from actune.substitutes.functions import OrderedConv, arg, conv_args
from actune.substitutes.lazy_logits import LazyHead, is_head

PLAIN_CONVS = (F.conv1d, F.conv2d, F.conv3d)
CONVS = (*PLAIN_CONVS, F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)
_KEEPS = "inputs rounded at matmul bits (backward linear in each)"

#: Ops whose activation operand holds features in its last dim: a layer's input times its
#: weight (linear, addmm, matmul with a weight), packed one feature per group.
FEATURES_LAST = (F.linear, torch.matmul, torch.mm, torch.addmm, torch.Tensor.matmul,
                 torch.Tensor.__matmul__, torch.Tensor.mm, torch.Tensor.addmm)
_BY_FEATURE = "; a weight's input in groups along its tokens, one feature each"

register(FEATURES_LAST[1:], "matmul", "matmul", _KEEPS + _BY_FEATURE, features_last=True)(None)

#: Grouped matmuls, in the spellings this torch has: a mixture-of-experts layer's tokens,
#: sorted by expert, times each expert's weight (Hugging Face's experts call ``F.grouped_mm``);
#: a linear layer per group of rows. (Dynamo calls no function mode for them: not
#: overridable functions, so compiled graphs keep their inputs exact.)
GROUPED_MATMULS = tuple(f for f in (getattr(F, "grouped_mm", None),
                                    getattr(torch, "_grouped_mm", None)) if f is not None)
register(GROUPED_MATMULS, "matmul", "matmul", _KEEPS + _BY_FEATURE + "; mixture-of-experts grouped "
         "matmuls alike", features_last=True)(None)


@register((F.linear,), "matmul", "matmul",
          _KEEPS + _BY_FEATURE + "; a marked language model head's logits lazy (computed "
          "in chunks by the loss)", features_last=True, weight_at=1)
def linear(s, func, args, kwargs, level):
    """A head :func:`actune.chunk_loss` marked returns :class:`LazyLogits`; every other linear
    layer runs as it is (its input packed by the hooks)."""
    weight = args[1] if len(args) > 1 else kwargs.get("weight")  # (every linear call)
    if not is_head(weight):
        return None
    return LazyHead.apply(args[0], weight, arg(args, kwargs, 2, "bias", None))
register((torch.bmm, torch.baddbmm, torch.addbmm, torch.einsum, torch.Tensor.__rmatmul__,
          torch.Tensor.bmm, torch.Tensor.baddbmm),
         "matmul", "matmul", _KEEPS)(None)
register((F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d), "matmul", "matmul", _KEEPS,
         weight_at=1)(None)
register((F.bilinear,), "matmul", "matmul", _KEEPS, weight_at=2)(None)


@register(PLAIN_CONVS, "matmul", "matmul", _KEEPS + "; large ones backward one tensor at a time",
          weight_at=1)
def ordered_conv(s, func, args, kwargs, level):
    """A large batched convolution runs :class:`OrderedConv` (same values, less memory)."""
    if level.matmul_bits is None:
        return None
    conv = conv_args(func, args, kwargs)
    return None if conv is None else OrderedConv.apply(*conv)
