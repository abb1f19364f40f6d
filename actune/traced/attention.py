"""Traced attention and loss: scaled-dot-product attention and cross entropy in compiled graphs.

Attention keeps q and k rounded at ``nonlinear_bits`` (8 at L2-L5: the backward recomputes the
softmax from them, a nonlinear use) and v at ``sensitive_bits`` (4 at L3; read linearly), and
its backward recomputes the attention map in torch ops (math form, as the eager rule's). Cross
entropy keeps the probabilities at ``sensitive_bits``: its gradient ``(p - onehot) / N`` is
linear in them. Both mirror the eager rules (:mod:`actune.rules.attention`,
:mod:`actune.rules.losses`).
"""

from __future__ import annotations

import math

import torch

from actune.traced.pack import pack, random_key, uniform, unpack

__all__ = ["PackedAttention", "PackedCrossEntropy", "RedrawnDropout"]


class PackedAttention(torch.autograd.Function):
    """``F.scaled_dot_product_attention`` without dropout, keeping q, k and v rounded."""

    @staticmethod
    def forward(ctx, q, k, v, mask, is_causal: bool, scale, qk_bits: int, v_bits: int,
                group_size: int, dropout_p: float = 0.0):
        scale = scale if scale is not None else 1 / math.sqrt(q.shape[-1])
        if dropout_p:  # the map, with a dropout mask drawn from a key backward draws again
            key = random_key(q.device)
            out = _dropped(_map(q.float(), k.float(), mask, is_causal, scale), key,
                           dropout_p) @ _heads(v.float(), q.shape[-3])
            out = out.to(q.dtype)
        else:
            key = None
            out = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
                enable_gqa=q.shape[-3] != k.shape[-3])
        ctx.meta = (q.shape, k.shape, v.shape, q.dtype, is_causal, scale, qk_bits, v_bits,
                    group_size, mask is not None, dropout_p)
        ctx.save_for_backward(*pack(q, qk_bits, group_size), *pack(k, qk_bits, group_size),
                              *pack(v, v_bits, group_size),
                              *(() if mask is None else (mask,)),
                              *(() if key is None else (key,)))
        return out

    @staticmethod
    def backward(ctx, grad):
        (q_shape, k_shape, v_shape, dtype, causal, scale, qk_bits, v_bits, gs, has_mask,
         dropout_p) = ctx.meta
        s = ctx.saved_tensors
        # q read through the incoming gradient (plus zero times one of its elements): what
        # follows depends on backward's input, so AOTAutograd's partitioner cannot move the
        # map's recomputation into the forward and save the map and q, k, v unpacked, whole
        q = unpack(s[0:3], qk_bits, q_shape, torch.float32, gs) + grad.reshape(-1)[0] * 0
        k = unpack(s[3:6], qk_bits, k_shape, torch.float32, gs)
        v = unpack(s[6:9], v_bits, v_shape, torch.float32, gs)
        groups = q_shape[-3] // k_shape[-3]
        k, v = _heads(k, q_shape[-3]), _heads(v, q_shape[-3])
        p = _map(q, k, s[9] if has_mask else None, causal, scale)
        g = grad.float()
        if dropout_p:
            kept = (uniform(p, s[-1]) >= dropout_p) / (1 - dropout_p)
            dv = (p * kept).transpose(-2, -1) @ g
            dp = (g @ v.transpose(-2, -1)) * kept
        else:
            dv = p.transpose(-2, -1) @ g
            dp = g @ v.transpose(-2, -1)
        ds = p * (dp - (dp * p).sum(-1, keepdim=True))
        dq = (ds @ k) * scale
        dk = (ds.transpose(-2, -1) @ q) * scale
        if groups > 1:
            dk = dk.unflatten(-3, (k_shape[-3], groups)).sum(-3)
            dv = dv.unflatten(-3, (k_shape[-3], groups)).sum(-3)
        return (dq.to(dtype), dk.to(dtype), dv.to(dtype), None, None, None, None, None, None,
                None)


def _heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """k or v with each head repeated for the q heads it serves (grouped-query attention)."""
    groups = heads // t.shape[-3]
    return t.repeat_interleave(groups, -3) if groups > 1 else t


def _map(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, causal: bool,
         scale: float) -> torch.Tensor:
    """``softmax(q k^T * scale)`` with the causal flag and a boolean or additive mask."""
    scores = q @ _heads(k, q.shape[-3]).transpose(-2, -1) * scale
    if causal:
        t, u = scores.shape[-2], scores.shape[-1]
        keep = torch.ones(t, u, dtype=torch.bool, device=scores.device).tril(u - t)
        scores = scores.masked_fill(~keep, float("-inf"))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool \
            else scores + mask.float()
    return torch.softmax(scores, -1)


def _dropped(p: torch.Tensor, key: torch.Tensor, dropout_p: float) -> torch.Tensor:
    """The map with dropout: entries kept where the key's uniform numbers reach ``dropout_p``,
    scaled by ``1 / (1 - dropout_p)``."""
    return p * (uniform(p, key) >= dropout_p) / (1 - dropout_p)


class RedrawnDropout(torch.autograd.Function):
    """``F.dropout`` in training keeping only a key: backward draws the same mask again from
    it (:func:`~actune.traced.pack.uniform`), where PyTorch's dropout saves its mask (a
    compiled graph may save it as float32, mask times scale: 4 bytes an element)."""

    @staticmethod
    def forward(ctx, x, p: float):
        key = random_key(x.device)
        ctx.save_for_backward(key)
        ctx.p = p
        return _dropped(x, key, p)

    @staticmethod
    def backward(ctx, grad):
        return _dropped(grad, ctx.saved_tensors[0], ctx.p), None


class PackedCrossEntropy(torch.autograd.Function):
    """Mean or summed cross entropy over ``(N, C)`` logits and ``(N,)`` class targets,
    keeping the probabilities rounded."""

    @staticmethod
    def forward(ctx, x, target, ignore_index: int, reduction: str, bits: int,
                group_size: int):
        logp = torch.log_softmax(x.float(), -1)
        valid = target != ignore_index
        safe = torch.where(valid, target, 0)
        losses = -logp.gather(1, safe.unsqueeze(1)).squeeze(1) * valid
        count = valid.sum()
        ctx.meta = (x.shape, x.dtype, reduction, bits, group_size)
        ctx.save_for_backward(*pack(logp.exp(), bits, group_size), safe, valid, count)
        return losses.sum() / count if reduction == "mean" else losses.sum()

    @staticmethod
    def backward(ctx, grad):
        shape, dtype, reduction, bits, group_size = ctx.meta
        codes, low, step, safe, valid, count = ctx.saved_tensors
        p = unpack((codes, low, step), bits, shape, torch.float32, group_size)
        onehot = torch.nn.functional.one_hot(safe, shape[-1]).float()
        scale = grad / count if reduction == "mean" else grad
        gx = (p - onehot) * valid.unsqueeze(1) * scale
        return gx.to(dtype), None, None, None, None, None
