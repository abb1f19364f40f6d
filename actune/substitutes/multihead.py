"""``F.multi_head_attention_forward`` (``nn.MultiheadAttention``) as the calls it makes.

PyTorch's function is one call to a function mode: the linear projections and the attention
inside it run with the mode off, so everything they save stays exact (a 128-wide
``nn.TransformerEncoderLayer``: 6-17 MiB a layer, batch 16 x 128). :func:`decompose` computes
its usual path (batched input, packed or separate input projections of one width, no
``bias_k``/``bias_v``/zero attention/static keys; an attention mask, boolean or additive, and a
key padding mask, merged as PyTorch merges them: WavLM's gated relative position bias is such
a mask, with a gradient; the attention weights returned too) as the same calls PyTorch's code
makes (``F.linear``, ``F.scaled_dot_product_attention``; with the weights ``baddbmm`` or
``bmm``, softmax, dropout), which a mode then routes one by one; elsewhere it returns None and
PyTorch's own code runs. Knows nothing of actune's sessions.
"""

from __future__ import annotations

import inspect
import math

import torch
import torch.nn.functional as F  # noqa: N812

__all__ = ["decompose"]

_SIGNATURE = inspect.signature(F.multi_head_attention_forward)
#: arguments that must hold these values for the usual path
_PLAIN = {"bias_k": None, "bias_v": None, "add_zero_attn": False, "static_k": None,
          "static_v": None}


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
    mask, padding, causal = a["attn_mask"], a["key_padding_mask"], bool(a["is_causal"])
    if (any(a[name] is not value_ and a[name] != value_ for name, value_ in _PLAIN.items())
            or query.dim() != 3 or key.dim() != 3 or key.shape != value.shape
            or (causal and mask is None)):  # (the hint alone: PyTorch raises)
        return None
    tgt_len, bsz, embed_dim = query.shape
    src_len, heads = key.shape[0], a["num_heads"]
    if embed_dim != a["embed_dim_to_check"] or embed_dim % heads:
        return None
    # the causal hint comes with its mask, which PyTorch's code drops for the hint where
    # neither a padding mask nor the weights need it; elsewhere the mask is used and the hint
    # dropped (merged with a padding mask, it is no longer causal)
    if causal and padding is None and not a["need_weights"]:
        mask = None
    else:
        causal = False
        mask = _merged(mask, padding, query.dtype, bsz, heads, tgt_len, src_len)
        if mask is _UNTAKEN:
            return None
    head_dim = embed_dim // heads
    q, k, v = _project(query, key, value, a)
    if q is None:
        return None
    q, k, v = (t.reshape(t.shape[0], bsz * heads, head_dim).transpose(0, 1) for t in (q, k, v))
    dropout_p = a["dropout_p"] if a["training"] else 0.0
    if a["need_weights"]:
        q = q * math.sqrt(1.0 / float(head_dim))
        weights = (torch.bmm(q, k.transpose(-2, -1)) if mask is None
                   else torch.baddbmm(mask, q, k.transpose(-2, -1)))
        weights = F.softmax(weights, dim=-1)
        if dropout_p > 0.0:
            weights = F.dropout(weights, p=dropout_p)
        out = torch.bmm(weights, v).transpose(0, 1).reshape(tgt_len * bsz, embed_dim)
        weights = weights.view(bsz, heads, tgt_len, -1)
        if a["average_attn_weights"]:
            weights = weights.mean(dim=1)
    else:
        q, k, v = (t.view(bsz, heads, t.shape[1], head_dim) for t in (q, k, v))
        if mask is not None:  # (bsz * heads or 1, L, S) -> SDPA's broadcastable 4-d mask
            mask = (mask.unsqueeze(0) if mask.shape[0] == 1
                    else mask.view(bsz, heads, -1, src_len))
        out = F.scaled_dot_product_attention(q, k, v, mask, dropout_p, causal)
        out = out.permute(2, 0, 1, 3).contiguous().view(bsz * tgt_len, embed_dim)
        weights = None
    out = F.linear(out, a["out_proj_weight"], a["out_proj_bias"])
    return out.view(tgt_len, bsz, out.size(1)), weights


#: What :func:`_merged` returns for a mask it does not take.
_UNTAKEN = object()


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True: not attended) as PyTorch's code makes it additive: 0 and -inf."""
    if mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
        mask, float("-inf"))


def _merged(mask, padding, dtype, bsz: int, heads: int, tgt_len: int, src_len: int):
    """The attention mask, ``(L, S)`` or ``(bsz * heads, L, S)``, and the key padding mask,
    ``(bsz, S)``, as one additive ``(bsz * heads or 1, L, S)`` mask (None if neither), as
    PyTorch's code merges them; :data:`_UNTAKEN` for shapes it would reject."""
    if mask is not None:
        if mask.dim() == 2 and mask.shape == (tgt_len, src_len):
            mask = mask.unsqueeze(0)
        elif mask.dim() != 3 or mask.shape != (bsz * heads, tgt_len, src_len):
            return _UNTAKEN
        mask = _additive(mask, dtype)
    if padding is not None:
        if padding.shape != (bsz, src_len):
            return _UNTAKEN
        padding = _additive(padding, dtype).view(bsz, 1, 1, src_len).expand(
            -1, heads, -1, -1).reshape(bsz * heads, 1, src_len)
        mask = padding if mask is None else mask + padding
    return mask


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
