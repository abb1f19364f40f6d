"""``F.multi_head_attention_forward`` (``nn.MultiheadAttention``) as the calls it makes.

PyTorch's function is one call to a function mode: the linear projections and the attention
inside it run with the mode off, so everything they save stays exact (a 128-wide
``nn.TransformerEncoderLayer``: 6-17 MiB a layer, batch 16 x 128). :func:`decompose` computes
its usual path (batched input, packed or separate input projections of one width, no
``bias_k``/``bias_v``/zero attention/static keys, no key padding mask, no mask or the causal
hint; the attention weights returned too, without a mask) as the same calls PyTorch's code
makes (``F.linear``, ``F.scaled_dot_product_attention``; with the weights ``bmm``, softmax,
dropout), which a mode then routes one by one; elsewhere it returns None and PyTorch's own
code runs. Knows nothing of actune's sessions.
"""

from __future__ import annotations

import inspect
import math

import torch
import torch.nn.functional as F  # noqa: N812

__all__ = ["decompose"]

_SIGNATURE = inspect.signature(F.multi_head_attention_forward)
#: arguments that must hold these values for the usual path
_PLAIN = {"bias_k": None, "bias_v": None, "add_zero_attn": False, "key_padding_mask": None,
          "static_k": None, "static_v": None}


def decompose(args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """``multi_head_attention_forward(*args, **kwargs)`` through ``F.linear`` and
    ``F.scaled_dot_product_attention`` (with ``need_weights``, the weights' own products,
    softmax and dropout, as PyTorch's code computes them), or None where the call leaves the
    usual path."""
    try:
        bound = _SIGNATURE.bind(*args, **kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    a = bound.arguments
    query, key, value = a["query"], a["key"], a["value"]
    masked, causal = a["attn_mask"] is not None, bool(a["is_causal"])
    # (the causal hint comes with its mask, which PyTorch's code then drops for the hint;
    # with the weights it keeps the mask: not taken here)
    if (any(a[name] is not value_ and a[name] != value_ for name, value_ in _PLAIN.items())
            or query.dim() != 3 or key.shape != value.shape
            or masked != causal  # (a mask of its own; or the hint alone: PyTorch raises)
            or (a["need_weights"] and masked)):
        return None
    tgt_len, bsz, embed_dim = query.shape
    heads = a["num_heads"]
    if embed_dim != a["embed_dim_to_check"] or embed_dim % heads:
        return None
    head_dim = embed_dim // heads
    q, k, v = _project(query, key, value, a)
    if q is None:
        return None
    q, k, v = (t.reshape(t.shape[0], bsz * heads, head_dim).transpose(0, 1) for t in (q, k, v))
    dropout_p = a["dropout_p"] if a["training"] else 0.0
    if a["need_weights"]:
        weights = torch.bmm(q * math.sqrt(1.0 / float(head_dim)), k.transpose(-2, -1))
        weights = F.softmax(weights, dim=-1)
        if dropout_p > 0.0:
            weights = F.dropout(weights, p=dropout_p)
        out = torch.bmm(weights, v).transpose(0, 1).reshape(tgt_len * bsz, embed_dim)
        weights = weights.view(bsz, heads, tgt_len, -1)
        if a["average_attn_weights"]:
            weights = weights.mean(dim=1)
    else:
        q, k, v = (t.view(bsz, heads, t.shape[1], head_dim) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, None, dropout_p, causal)
        out = out.permute(2, 0, 1, 3).contiguous().view(bsz * tgt_len, embed_dim)
        weights = None
    out = F.linear(out, a["out_proj_weight"], a["out_proj_bias"])
    return out.view(tgt_len, bsz, out.size(1)), weights


def _project(query, key, value, a):
    """The query, key and value projections (one product for self-attention with a packed
    weight, as PyTorch's code makes); (None, None, None) for a layout it does not take."""
    bias = a["in_proj_bias"]
    if a["use_separate_proj_weight"]:
        weights = (a["q_proj_weight"], a["k_proj_weight"], a["v_proj_weight"])
        if any(w is None for w in weights):
            return None, None, None
    else:
        packed = a["in_proj_weight"]
        if packed is None:
            return None, None, None
        if query is key and key is value:  # self-attention: one product, then split
            proj = F.linear(query, packed, bias)
            # (reshape: Tensor.unflatten calls super() in Python, which Dynamo does not trace
            # under a function mode)
            return proj.reshape(*proj.shape[:-1], 3, query.shape[-1]).unbind(-2)
        weights = packed.chunk(3)
    biases = (None,) * 3 if bias is None else bias.chunk(3)
    return tuple(F.linear(t, w, b) for t, w, b in zip((query, key, value), weights, biases,
                                                      strict=True))
