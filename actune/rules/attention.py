"""Attention: ``F.scaled_dot_product_attention`` on whichever backend PyTorch picks (math,
flash, memory-efficient, cuDNN), with masks, the causal flag, dropout and ``enable_gqa``.

PyTorch's backends keep q, k, v, the output and the log-sum-exp; their backward recomputes
``softmax(q k^T)`` (nonlinear in q and k) and is linear in v. :class:`RecomputedAttention` keeps
v rounded at ``sensitive_bits`` (4 at L3: its noise sets the small gradients of q and k;
unbiased), q and k at the level's ``nonlinear_bits`` (8 at L2-L5: their rounding enters the
softmax nonlinearly, a bias measured in docs/training.md; exact where the level sets none),
and neither the output nor the log-sum-exp: backward runs the attention forward once more
(with the forward's random state, for dropout, and its autocast state) and differentiates
that. Eager attention (matmuls, masks, softmax, dropout) is covered by those ops' own rules.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F  # noqa: N812

from actune.rules import register
from actune.rules.activations import compressible
from actune.saved import check_double_backward, get_many, plain_saving, take
from actune.substitutes import arg

_LABEL = "scaled_dot_product_attention q/k"


@register((F.scaled_dot_product_attention,), "attention", None,
          "v rounded at sensitive bits; q and k at nonlinear bits (8 at L2-L5) or exact; the "
          "output and log-sum-exp recomputed in backward")
def attention(s, func, args, kwargs, level):
    q, k, v = args[0], arg(args, kwargs, 1, "key", None), arg(args, kwargs, 2, "value", None)
    mask = arg(args, kwargs, 3, "attn_mask", None)
    if (not all(isinstance(t, torch.Tensor) and t.is_floating_point() for t in (q, k, v))
            or not compressible(v, level)
            or (isinstance(mask, torch.Tensor) and mask.requires_grad)):
        return None  # a learned mask (its gradient reads the probabilities): PyTorch's own
    options = (mask, float(arg(args, kwargs, 4, "dropout_p", 0.0)),
               bool(arg(args, kwargs, 5, "is_causal", False)), arg(args, kwargs, 6, "scale", None),
               bool(kwargs.get("enable_gqa", False)))
    return RecomputedAttention.apply(q, k, v, options, level, s)


def _sdpa(q, k, v, options):
    mask, dropout_p, is_causal, scale, gqa = options
    extra = {"enable_gqa": True} if gqa else {}
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                          is_causal=is_causal, scale=scale, **extra)


class RecomputedAttention(torch.autograd.Function):
    """Attention keeping v rounded, q and k at ``nonlinear_bits`` (or exact), and recomputing
    the rest in backward (see the module docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, options, level, session):
        device = q.device
        ctx.rng = _rng_state(device) if options[1] > 0 else None
        ctx.autocast = (device.type, torch.is_autocast_enabled(device.type),
                        torch.get_autocast_dtype(device.type))
        out = _sdpa(q, k, v, options)
        session.count(out)  # what PyTorch's backends keep besides q, k and v
        bits = level.nonlinear_bits
        v_bits = level.sensitive_width
        if bits is None:
            ctx.q, ctx.k = (session.keep_exact(t, _LABEL) for t in (q, k))
            ctx.v = session.pack_fixed(v, v_bits, "attention v", replaces=(v,))
        else:  # small ones in one kernel call
            ctx.q, ctx.k, ctx.v = session.pack_fixed_many(
                [(q, bits, "attention q/k"), (k, bits, "attention q/k"), (v, v_bits,
                                                                         "attention v")])
        ctx.options = options
        return out

    @staticmethod
    def backward(ctx, grad):
        check_double_backward()
        needs = ctx.needs_input_grad[:3]
        inputs = [t.detach().requires_grad_(need) for t, need in
                  zip(get_many([take(ctx, name) for name in "qkv"]), needs, strict=True)]
        with torch.enable_grad(), _replayed(ctx), plain_saving():
            out = _sdpa(*inputs, ctx.options)
        wanted = [t for t, need in zip(inputs, needs, strict=True) if need]
        found = iter(torch.autograd.grad(out, wanted, grad) if wanted else ())
        return (*(next(found) if need else None for need in needs), None, None, None)


def _rng_state(device: torch.device):
    if device.type == "cuda":
        return device, torch.cuda.get_rng_state(device)
    return device, torch.get_rng_state()


@contextlib.contextmanager
def _replayed(ctx):
    """The forward's autocast state and (with dropout) random state."""
    device_type, enabled, dtype = ctx.autocast
    autocast = torch.autocast(device_type, dtype=dtype, enabled=enabled)
    if ctx.rng is None:
        with autocast:
            yield
        return
    device, state = ctx.rng
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, device_type=device.type), autocast:
        if device.type == "cuda":
            torch.cuda.set_rng_state(state, device)
        else:
            torch.set_rng_state(state)
        yield
