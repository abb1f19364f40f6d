"""Norms: batch, layer, group, instance and RMS norm.

Their backward reads the saved input linearly once the statistics (mean, rstd) are fixed, and
the statistics nonlinearly: only the tensor of the input's shape is rounded (``other_bits``);
the per-row or per-channel statistics are small and stay exact, the weight, bias and running
statistics stay references. Large training-mode batch norms in float32/64 run
:class:`~actune.substitutes.LeanBatchNorm` (two activation-sized tensors in backward, not three;
optionally writing over a convolution's output that nothing else reads).

The bias this leaves is of order (rounding variance) / (elements reduced over): invisible at
the sizes of real layers (docs/training.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812

from actune import substitutes
from actune.rules import register
from actune.substitutes import LeanBatchNorm, arg

_KEEPS = "input rounded at other bits; statistics exact"

register((F.layer_norm, F.rms_norm), "norm", "other",
         _KEEPS + "; in groups along its tokens, one feature each", only_input_shape=True,
         features_last=True)(None)
register((F.group_norm, F.instance_norm), "norm", "other", _KEEPS, only_input_shape=True)(None)


@register((F.batch_norm,), "norm", "other", _KEEPS + "; large ones backward in place",
          only_input_shape=True)
def lean_batch_norm(s, func, args, kwargs, level):
    """A large training-mode batch norm runs :class:`LeanBatchNorm`."""
    if level.other_bits is None:
        return None
    norm = _lean_norm_args(s, args, kwargs)
    if norm is None:
        return None
    out = LeanBatchNorm.apply(*norm, s.pack_hook)
    if out is norm[0]:  # overwritten: a new value, in its own storage in PyTorch
        s.forget(out)
    return out


def _lean_norm_args(s, args, kwargs) -> tuple | None:
    """(x, weight, bias, running_mean, running_var, momentum, eps, overwrite) of a training-mode
    batch norm that :class:`LeanBatchNorm` should run, or None (PyTorch's own: small inputs,
    half precision, autocast)."""
    x = args[0]
    weight, bias = arg(args, kwargs, 3, "weight", None), arg(args, kwargs, 4, "bias", None)
    momentum = arg(args, kwargs, 6, "momentum", 0.1)
    if (not arg(args, kwargs, 5, "training", False) or x.dim() < 2
            or x.numel() < substitutes.LEAN_NUMEL or x.dtype not in (torch.float32, torch.float64)
            or torch.is_autocast_enabled(x.device.type) or not isinstance(momentum, float | int)
            or any(t is not None and t.dtype != x.dtype for t in (weight, bias))):
        return None
    ap = s.allocator()
    overwrite = (s.overwritable.pop(x, False) and not x.is_leaf and x._base is None
                 and not (ap is not None and ap.collecting))  # statistics read the input after
    return (x, weight, bias, arg(args, kwargs, 1, "running_mean", None),
            arg(args, kwargs, 2, "running_var", None), float(momentum),
            float(arg(args, kwargs, 7, "eps", 1e-5)), overwrite)
