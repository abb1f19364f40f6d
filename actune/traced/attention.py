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

from actune.traced.pack import pack, unpack

__all__ = ["PackedAttention", "PackedCrossEntropy"]


class PackedAttention(torch.autograd.Function):
    """``F.scaled_dot_product_attention`` without dropout, keeping q, k and v rounded."""

    @staticmethod
    def forward(ctx, q, k, v, mask, is_causal: bool, scale, qk_bits: int, v_bits: int,
                group_size: int):
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
            enable_gqa=q.shape[-3] != k.shape[-3])
        ctx.meta = (q.shape, k.shape, v.shape, q.dtype, is_causal,
                    scale if scale is not None else 1 / math.sqrt(q.shape[-1]), qk_bits,
                    v_bits, group_size, mask is not None)
        ctx.save_for_backward(*pack(q, qk_bits, group_size), *pack(k, qk_bits, group_size),
                              *pack(v, v_bits, group_size),
                              *(() if mask is None else (mask,)))
        return out

    @staticmethod
    def backward(ctx, grad):
        q_shape, k_shape, v_shape, dtype, causal, scale, qk_bits, v_bits, gs, has_mask = ctx.meta
        s = ctx.saved_tensors
        q = unpack(s[0:3], qk_bits, q_shape, torch.float32, gs)
        k = unpack(s[3:6], qk_bits, k_shape, torch.float32, gs)
        v = unpack(s[6:9], v_bits, v_shape, torch.float32, gs)
        groups = q_shape[-3] // k_shape[-3]
        if groups > 1:  # grouped-query attention: each k/v head serves `groups` q heads
            k, v = k.repeat_interleave(groups, -3), v.repeat_interleave(groups, -3)
        scores = q @ k.transpose(-2, -1) * scale
        if causal:
            t, u = scores.shape[-2], scores.shape[-1]
            keep = torch.ones(t, u, dtype=torch.bool, device=scores.device).tril(u - t)
            scores = scores.masked_fill(~keep, float("-inf"))
        if has_mask:
            mask = s[9]
            scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool \
                else scores + mask.float()
        p = torch.softmax(scores, -1)
        g = grad.float()
        dv = p.transpose(-2, -1) @ g
        dp = g @ v.transpose(-2, -1)
        ds = p * (dp - (dp * p).sum(-1, keepdim=True))
        dq = (ds @ k) * scale
        dk = (ds.transpose(-2, -1) @ q) * scale
        if groups > 1:
            dk = dk.unflatten(-3, (k_shape[-3], groups)).sum(-3)
            dv = dv.unflatten(-3, (k_shape[-3], groups)).sum(-3)
        return (dq.to(dtype), dk.to(dtype), dv.to(dtype), None, None, None, None, None, None)


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
