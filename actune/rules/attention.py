"""Attention: ``F.scaled_dot_product_attention`` on whichever backend PyTorch picks (math,
flash, memory-efficient, cuDNN), with masks, the causal flag, dropout and ``enable_gqa``.

PyTorch's backends keep q, k, v, the output and the log-sum-exp; their backward recomputes
``softmax(q k^T)`` (nonlinear in q and k) and is linear in v. :class:`RecomputedAttention` keeps
v rounded at ``sensitive_bits`` (4 at L3: its noise sets the small gradients of q and k;
unbiased), q and k at the level's ``nonlinear_bits`` (8 at L2-L5: their rounding enters the
softmax nonlinearly, a bias measured in docs/training.md; exact where the level sets none),
and neither the output nor the log-sum-exp: backward runs the attention forward once more
(with the forward's random state, for dropout, and its autocast state) and differentiates
that. With dropout on the CPU (where PyTorch's only backend for it is its math one, drawing
the mask with ``bernoulli_``) the rule computes the same math itself, the dropout mask drawn
from a seed (:mod:`actune.packing.random_masks`) and drawn again in backward: nothing more is kept,
and the forward takes 0.4x of PyTorch's time there (docs/benchmarks.md). Under autocast too
(the recomputation replays it). Forward and backward take a slice of the batch at a time
where the whole batch's maps would pass :data:`tunables.ATTENTION_MAP_SLICE`: PyTorch's math form
holds the
scores, probabilities and their gradients for all of it at once.

A learned additive bias (a float ``attn_mask`` that requires grad: a relative position bias)
gets its gradient from the same recomputation; the bias is kept as a reference when it is a
parameter, else as a 1-bit mask of the entries it masks (far below their row's largest:
``exp`` of them is 0) and the rest at ``nonlinear_bits`` (it enters the softmax nonlinearly,
like q and k; exact where the level sets none). Eager attention (matmuls, the bias's add,
softmax, dropout) is covered by those ops' own rules.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F  # noqa: N812
from torch._subclasses.fake_tensor import FakeTensor

from actune import tunables
from actune.packing.random_masks import drawn_here, keep_mask
from actune.packing.saved import check_double_backward, get_many, plain_saving, take
from actune.rules.activations import compressible
from actune.rules.registry import register
from actune.substitutes.functions import arg, autocast_dtype
from actune.substitutes.multihead import decompose

_LABEL = "scaled_dot_product_attention q/k"
_BIAS_LABEL = "scaled_dot_product_attention bias"


@register((F.scaled_dot_product_attention,), "attention", None,
          "v rounded at sensitive bits; q and k at nonlinear bits (8 at L2-L5) or exact; the "
          "output and log-sum-exp recomputed in backward; a learned bias as a 1-bit mask and "
          "nonlinear bits")
def attention(s, func, args, kwargs, level):
    q, k, v = args[0], arg(args, kwargs, 1, "key", None), arg(args, kwargs, 2, "value", None)
    mask = arg(args, kwargs, 3, "attn_mask", None)
    if (not all(isinstance(t, torch.Tensor) and t.is_floating_point() for t in (q, k, v))
            or not (compressible(v, level) or compressible(q, level)
                    or compressible(k, level))):
        # (keys and values may be few where the queries are many: SegFormer's attention
        # over a spatially reduced sequence; the queries and the output then weigh most)
        return None
    bias = mask if isinstance(mask, torch.Tensor) and mask.requires_grad else None
    options = (None if bias is not None else mask, float(arg(args, kwargs, 4, "dropout_p", 0.0)),
               bool(arg(args, kwargs, 5, "is_causal", False)), arg(args, kwargs, 6, "scale", None),
               bool(kwargs.get("enable_gqa", False)))
    return RecomputedAttention.apply(q, k, v, bias, options, level, s)


def _sdpa(q, k, v, options, bias=None):
    mask, dropout_p, is_causal, scale, gqa = options
    extra = {"enable_gqa": True} if gqa else {}
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask if bias is None else bias,
                                          dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                                          **extra)


def _math(q, k, v, options, bias, seed, keep=None):
    """PyTorch's math attention (scaled ``q k^T``, the mask or bias, a softmax that gives 0
    for fully masked rows, dropout, ``@ v``) with dropout's mask drawn from ``seed`` (or
    ``keep``, drawn already)."""
    mask, dropout_p, is_causal, scale, gqa = options
    if gqa and k.shape[-3] != q.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], -3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], -3)
    scale = 1.0 / (q.shape[-1] ** 0.5) if scale is None else scale
    scores = torch.matmul(q * scale, k.transpose(-2, -1))
    mask = mask if bias is None else bias
    if is_causal:
        rows, cols = scores.shape[-2:]
        upper = torch.ones(rows, cols, dtype=torch.bool, device=q.device).triu_(1)
        scores = scores.masked_fill(upper, float("-inf"))
    if mask is not None:
        scores = (scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool
                  else scores + mask)
    probs = torch.ops.aten._safe_softmax(scores, -1)
    if keep is None:
        keep = keep_mask(probs.shape, 1 - dropout_p, seed, probs)
    return torch.matmul(probs * keep, v).div_(1 - dropout_p)


def _slices(q, k, v, options) -> tuple[torch.Size, int] | None:
    """The math path's whole map shape and the rows of ``q``'s first dim per slice, or None
    where the batch cannot be cut there (broadcast operands, one row)."""
    mask, gqa = options[0], options[4]
    rows = q.shape[0]
    if q.dim() < 3 or rows < 2 or k.shape[0] != rows or v.shape[0] != rows:
        return None
    if mask is not None and mask.dim() == q.dim() and mask.shape[0] not in (1, rows):
        return None
    if not gqa and q.shape[:-2] != k.shape[:-2]:
        return None  # (broadcast batch dims)
    shape = torch.Size((*q.shape[:-1], k.shape[-2]))  # (with gqa: q's heads)
    per_row = shape.numel() // rows
    step = max(1, tunables.ATTENTION_MAP_SLICE // max(per_row, 1))
    return (shape, step) if step < rows else None


def _starts(q: torch.Tensor, step: int) -> range:
    """The first row of each slice; in an estimate (fake tensors) the first slice's alone:
    every slice allocates and frees the same, so one gives the step's peak, without
    hundreds of shape-only ops per call. (Traced by torch.compile, whose tensors are fake
    too: every slice.)"""
    estimate = isinstance(q, FakeTensor) and not torch.compiler.is_compiling()
    return range(0, step if estimate else q.shape[0], step)


def _sliced_options(options, rows: slice, batch: int):
    mask = options[0]
    if mask is not None and mask.dim() >= 3 and mask.shape[0] == batch and batch > 1:
        return (mask[rows], *options[1:])
    return options


def _math_forward(q, k, v, options, seed):
    """:func:`_math` without a learned bias, a slice of the batch at a time where it is
    large (the same values; the dropout mask drawn whole, one byte an element)."""
    cut = _slices(q, k, v, options)
    if cut is None:
        return _math(q, k, v, options, None, seed)
    shape, step = cut
    keep = keep_mask(shape, 1 - options[1], seed, q)
    out = q.new_empty((*q.shape[:-1], v.shape[-1]))
    for start in _starts(q, step):
        rows = slice(start, start + step)
        out[rows] = _math(q[rows], k[rows], v[rows], _sliced_options(options, rows, q.shape[0]),
                          None, seed, keep[rows])
    return out


def _math_backward(inputs, needs, options, seed, grad):
    """The gradients of :func:`_math_forward` for the ``inputs`` (q, k, v) that ``needs``
    names, a slice at a time where the forward sliced."""
    q, k, v = inputs
    cut = _slices(q, k, v, options)
    if cut is None:
        with torch.enable_grad():
            out = _math(q, k, v, options, None, seed)
        wanted = [t for t, need in zip(inputs, needs, strict=True) if need]
        found = iter(torch.autograd.grad(out, wanted, grad) if wanted else ())
        return [next(found) if need else None for need in needs]
    shape, step = cut
    keep = keep_mask(shape, 1 - options[1], seed, q)
    grads = [torch.empty_like(t) if need else None for t, need in zip(inputs, needs,
                                                                     strict=True)]
    for start in _starts(q, step):
        rows = slice(start, start + step)
        part = [t[rows].detach().requires_grad_(need) for t, need in zip(inputs, needs,
                                                                        strict=True)]
        with torch.enable_grad():
            out = _math(*part, _sliced_options(options, rows, q.shape[0]), None, seed,
                        keep[rows])
        wanted = [t for t, need in zip(part, needs, strict=True) if need]
        found = iter(torch.autograd.grad(out, wanted, grad[rows]) if wanted else ())
        for g, need in zip(grads, needs, strict=True):
            if need:
                g[rows] = next(found)
        del out, part
    return grads


#: an entry of a learned bias this far below its row's largest is a mask: ``exp`` of it
#: underflows to 0 in float32 and float64 alike, whatever q k^T adds within that margin
MASKED_BELOW = 1e3


def _pack_bias(session, bias: torch.Tensor, q: torch.Tensor, level) -> tuple:
    """A learned bias as backward needs it (see the module docstring): ``(kept,)`` or
    ``(masked, values)``."""
    bits = level.nonlinear_bits
    if bias.is_leaf:
        return (bias,)  # a parameter (a leaf that requires grad): held anyway, costs nothing
    if bits is None:
        return (session.packer.keep_exact(bias, _BIAS_LABEL),)
    detached = bias.detach()
    floor = torch.finfo(bias.dtype).min / 2
    masked = (detached < detached.amax(-1, keepdim=True) - MASKED_BELOW) | (detached <= floor)
    values = detached.masked_fill(masked, 0.0)
    return (session.packer.pack_bool(masked, "attention bias mask", replaces=(bias,)),
            session.packer.pack_fixed(values, bits, "attention bias"))


def _unpack_bias(kept: tuple, dtype: torch.dtype) -> torch.Tensor:
    if len(kept) == 1:
        return get_many(list(kept))[0]
    masked, values = get_many(list(kept))
    return values.to(dtype).masked_fill(masked, torch.finfo(dtype).min)


class RecomputedAttention(torch.autograd.Function):
    """Attention keeping v rounded, q and k at ``nonlinear_bits`` (or exact), and recomputing
    the rest in backward (see the module docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, bias, options, level, session):
        device = q.device
        drawn = options[1] > 0 and drawn_here(q)
        ctx.seed = session.packer.draw_seed(q) if drawn else None
        ctx.rng = _rng_state(device) if options[1] > 0 and not drawn else None
        ctx.autocast = (device.type, autocast_dtype(device.type))
        if not drawn:
            out = _sdpa(q, k, v, options, bias)
        elif bias is None:
            out = _math_forward(q, k, v, options, ctx.seed)
        else:
            out = _math(q, k, v, options, bias, ctx.seed)
        session.accounting.count(out)  # what PyTorch's backends keep besides q, k and v
        ctx.bias = None if bias is None else _pack_bias(session, bias, q, level)
        ctx.bias_dtype = None if bias is None else bias.dtype
        bits = level.nonlinear_bits
        v_bits = level.sensitive_width
        if bits is None:
            ctx.q, ctx.k = (session.packer.keep_exact(t, _LABEL) for t in (q, k))
            ctx.v = session.packer.pack_fixed(v, v_bits, "attention v", replaces=(v,))
        else:  # small ones in one kernel call
            ctx.q, ctx.k, ctx.v = session.packer.pack_fixed_many(
                [(q, bits, "attention q/k"), (k, bits, "attention q/k"), (v, v_bits,
                                                                         "attention v")])
        ctx.options = options
        return out

    @staticmethod
    def backward(ctx, grad):
        check_double_backward()
        needs = ctx.needs_input_grad[:4]
        inputs = [t.detach().requires_grad_(need) for t, need in
                  zip(get_many([take(ctx, name) for name in "qkv"]), needs[:3], strict=True)]
        if ctx.seed is not None and ctx.bias is None:  # the math path, sliced
            with _replayed(ctx), plain_saving():
                found = _math_backward(inputs, needs[:3], ctx.options, ctx.seed, grad)
            return (*found, None, None, None, None)
        if ctx.bias is not None:
            inputs.append(_unpack_bias(take(ctx, "bias"), ctx.bias_dtype).detach()
                          .requires_grad_(needs[3]))
        with torch.enable_grad(), _replayed(ctx), plain_saving():
            out = (_sdpa(*inputs[:3], ctx.options, *inputs[3:]) if ctx.seed is None
                   else _math(*inputs[:3], ctx.options, (inputs[3:] or [None])[0], ctx.seed))
        wanted = [t for t, need in zip(inputs, needs, strict=False) if need]
        found = iter(torch.autograd.grad(out, wanted, grad) if wanted else ())
        return (*(next(found) if need else None for need in needs), None, None, None)


def _rng_state(device: torch.device):
    if device.type == "cuda":
        return device, torch.cuda.get_rng_state(device)
    return device, torch.get_rng_state()


@contextlib.contextmanager
def _replayed(ctx):
    """The forward's autocast state and (with dropout) random state."""
    device_type, dtype = ctx.autocast
    autocast = (contextlib.nullcontext() if device_type == "meta"  # (no autocast there)
                else torch.autocast(device_type, dtype=dtype, enabled=dtype is not None))
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


@register((F.multi_head_attention_forward,), "attention", None,
          "nn.MultiheadAttention's usual path computed as its calls (the projections' "
          "inputs at matmul bits, the attention as scaled_dot_product_attention's rule, or "
          "with its weights returned as their products' and softmax's), its masks merged "
          "as PyTorch's; elsewhere (bias_k, zero attention...) PyTorch's own code, exact")
def multihead_attention(s, func, args, kwargs, level):
    with s.routing():  # (its calls routed one by one, as a model's own would be)
        return decompose(args, kwargs)
