"""Autograd functions whose forward packs what their backward reads, in torch ops.

Traced by Dynamo into the compiled forward and backward graphs, so each pack runs right after
the op that produced its tensor and each unpack right before the op that reads it: the
partitioner saves the packed bytes. What each keeps mirrors the eager rules
(:mod:`actune.rules`), at uniform widths (the bit allocator does not run in a graph):

* a layer's input (linear, addmm with a weight): rounded at matmul bits, in groups along the
  tokens, one feature each; the weight stays a reference;
* both operands of a product of two activations (``q @ k^T``, ``attn @ v``) at matmul bits;
* an activation's derivative (GELU, SiLU, Hardswish, Mish, ELU, SELU, softplus, logsigmoid,
  softsign, tanhshrink) at other bits, used linearly; GELU's, at a level with
  ``derivative_codes``, as the index of its nearest level on a fixed codebook;
* a piecewise-linear activation's two slopes (ReLU6, hardtanh, hardsigmoid, leaky ReLU): one
  bit per element;
* a norm's normalised input at other bits, its ``rstd`` exact;
* softmax's output as two independently rounded copies (its backward is quadratic in it), as
  ``F.normalize``'s input; a vector 2-norm's input at other bits, the norm exact.

Every backward product is linear in each rounded tensor: the gradients are unbiased, up to a
norm's term of order (rounding variance) / (elements normalised over), as in eager.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F  # noqa: N812

from actune.substitutes.functions import softmax_shift
from actune.substitutes.grid_sample import grid_sample_backward, reads_input
from actune.traced.convolutions import pack_bits, unpack_bits
from actune.traced.pack import (
    in_memory_order,
    join_codes,
    memory_order,
    pack,
    pack_range,
    split_codes,
    unpack,
    unpack_range,
)

__all__ = ["DERIVATIVES", "TWO_SLOPES", "BroadcastProduct", "DerivativeCodes", "GatedProduct",
           "PackedDerivative", "PackedGridSample", "PackedLinear", "PackedNorm",
           "PackedProduct", "PackedVectorNorm", "TwoCopyNormalize", "TwoCopySoftmax",
           "TwoSlopes", "carry_copy", "shared_copy", "softmax_sharing_copy"]


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def _weight_gradient(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``grad^T @ x`` over all tokens, as a batched product of one: Inductor rewrites
    ``mm(a, b) + c`` into one ``addmm`` and runs it where ``c`` is ready. For a weight used
    twice, a language model's head tied to its embedding, ``c`` is the embedding's gradient,
    made last: the logits' gradient (the step's largest tensor) was held through the whole
    backward (Hugging Face GPT-2: 15.6 MiB, the compiled step's peak 43.9 -> 30.1 MiB)."""
    return torch.bmm(_rows(grad).t().unsqueeze(0), _rows(x).unsqueeze(0)).squeeze(0)


class PackedLinear(torch.autograd.Function):
    """``F.linear(x, w, b)`` keeping ``x`` rounded (only if ``w`` needs a gradient)."""

    @staticmethod
    def forward(ctx, x, w, b, bits: int, group_size: int):
        ctx.meta = (x.shape, x.dtype, bits, group_size)
        keep = ctx.needs_input_grad[1]
        ctx.save_for_backward(w, *(pack(x, bits, group_size, True) if keep else ()))
        return F.linear(x, w, b)

    @staticmethod
    def backward(ctx, grad):
        w, *packed = ctx.saved_tensors
        shape, dtype, bits, group_size = ctx.meta
        gx = grad @ w.to(grad.dtype) if ctx.needs_input_grad[0] else None
        gw = gb = None
        if ctx.needs_input_grad[1]:
            x = unpack(tuple(packed), bits, shape, dtype, group_size, True)
            gw = _weight_gradient(grad, x.to(grad.dtype)).to(w.dtype)
        if ctx.needs_input_grad[2]:
            gb = _rows(grad).sum(0)
        return gx, gw, gb, None, None


class PackedVectorNorm(torch.autograd.Function):
    """The 2-norm of ``x`` over ``dim`` keeping ``x`` rounded and the norm exact: backward
    ``grad * x / norm`` (0 where the norm is), linear in ``x``."""

    @staticmethod
    def forward(ctx, x, dim, keepdim: bool, bits: int, group_size: int):
        n = torch.linalg.vector_norm(x, 2, dim, keepdim)
        ctx.meta = (x.shape, x.dtype, dim, keepdim, bits, group_size)
        ctx.save_for_backward(n, *pack(x, bits, group_size))
        return n

    @staticmethod
    def backward(ctx, grad):
        shape, dtype, dim, keepdim, bits, group_size = ctx.meta
        n, *packed = ctx.saved_tensors
        if not keepdim:  # (the reduced dims back, so that both broadcast over x)
            dims = range(len(shape)) if dim is None else sorted(
                d % len(shape) for d in ((dim,) if isinstance(dim, int) else dim))
            for d in dims:
                grad, n = grad.unsqueeze(d), n.unsqueeze(d)
        x = unpack(tuple(packed), bits, shape, grad.dtype, group_size)
        scale = torch.where(n > 0, grad / n, torch.zeros_like(grad))
        return (x * scale).to(dtype), None, None, None, None


class TwoCopyNormalize(torch.autograd.Function):
    """``F.normalize(x, 2, dim, eps)`` keeping two independently rounded copies of ``x`` and
    its norm exact: backward ``g / d - [n >= eps] x1 <g, x2> / n**3``, unbiased although
    quadratic in ``x`` (as softmax's two copies)."""

    @staticmethod
    def forward(ctx, x, dim, eps: float, bits: int, group_size: int):
        n = torch.linalg.vector_norm(x, 2, dim, keepdim=True)
        ctx.meta = (x.shape, x.dtype, dim, eps, bits, group_size)
        ctx.save_for_backward(n, *pack(x, bits, group_size), *pack(x, bits, group_size))
        return x / n.clamp_min(eps)

    @staticmethod
    def backward(ctx, grad):
        shape, dtype, dim, eps, bits, group_size = ctx.meta
        n, *packed = ctx.saved_tensors
        x1 = unpack(tuple(packed[:3]), bits, shape, grad.dtype, group_size)
        x2 = unpack(tuple(packed[3:]), bits, shape, grad.dtype, group_size)
        d = n.clamp_min(eps)
        inner = (grad * x2).sum(dim, keepdim=True)
        scale = torch.where(n >= eps, inner / d.pow(3), torch.zeros_like(inner))
        return (grad / d - x1 * scale).to(dtype), None, None, None, None


class PackedGridSample(torch.autograd.Function):
    """``torch.grid_sampler`` keeping its grid exact and its input at ``bits`` where the grid's
    gradient reads it, else nothing of the input (:mod:`actune.substitutes.grid_sample`)."""

    @staticmethod
    def forward(ctx, x, grid, mode: int, padding: int, align_corners: bool, bits: int,
                group_size: int):
        reads = reads_input(mode, ctx.needs_input_grad[1])
        ctx.meta = (x.shape, x.dtype, mode, padding, align_corners, bits, group_size, reads)
        ctx.save_for_backward(grid, *(pack(x, bits, group_size) if reads else ()))
        return torch.grid_sampler(x, grid, mode, padding, align_corners)

    @staticmethod
    def backward(ctx, grad):
        shape, dtype, mode, padding, align_corners, bits, group_size, reads = ctx.meta
        grid, *packed = ctx.saved_tensors
        x = unpack(tuple(packed), bits, shape, grad.dtype, group_size) if reads else None
        gx, ggrid = grid_sample_backward(grad, x, shape, grid, mode, padding, align_corners,
                                         ctx.needs_input_grad[:2])
        return (None if gx is None else gx.to(dtype)), ggrid, None, None, None, None, None


class PackedProduct(torch.autograd.Function):
    """``a @ b`` of two activations of the same batch shape, each kept rounded for the other's
    gradient. ``a_codes, a_low, a_step``: ``a`` already packed at these bits (a softmax's
    first copy, :class:`TwoCopySoftmax`), kept instead of packing it again."""

    @staticmethod
    def forward(ctx, a, b, bits: int, group_size: int, a_codes=None, a_low=None, a_step=None):
        ctx.meta = (a.shape, b.shape, a.dtype, b.dtype, bits, group_size)
        need_a, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        ctx.which = (need_b, need_a)  # a is read for b's gradient, b for a's
        kept = []
        if need_b:
            kept += (a_codes, a_low, a_step) if a_codes is not None else \
                pack(a, bits, group_size)
        if need_a:
            kept += pack(b, bits, group_size)
        ctx.save_for_backward(*kept)
        return a @ b

    @staticmethod
    def backward(ctx, grad):
        a_shape, b_shape, a_dtype, b_dtype, bits, group_size = ctx.meta
        kept = list(ctx.saved_tensors)
        a = b = None
        if ctx.which[0]:
            a = unpack(tuple(kept[:3]), bits, a_shape, a_dtype, group_size)
            kept = kept[3:]
        if ctx.which[1]:
            b = unpack(tuple(kept[:3]), bits, b_shape, b_dtype, group_size)
        ga = grad @ b.transpose(-2, -1) if b is not None else None
        gb = a.transpose(-2, -1) @ grad if a is not None else None
        return ga, gb, None, None, None, None, None


class GatedProduct(torch.autograd.Function):
    """``a * b`` of two activations of one shape (SwiGLU's ``act(gate) * up``), each kept
    rounded (independently) for the other's gradient."""

    @staticmethod
    def forward(ctx, a, b, bits: int, group_size: int):
        ctx.meta = (a.shape, a.dtype, b.dtype, bits, group_size)
        ctx.save_for_backward(*pack(a, bits, group_size, True), *pack(b, bits, group_size, True))
        return a * b

    @staticmethod
    def backward(ctx, grad):
        shape, a_dtype, b_dtype, bits, group_size = ctx.meta
        s = ctx.saved_tensors
        a = unpack(s[:3], bits, shape, grad.dtype, group_size, True)
        b = unpack(s[3:], bits, shape, grad.dtype, group_size, True)
        return (grad * b).to(a_dtype), (grad * a).to(b_dtype), None, None


class BroadcastProduct(torch.autograd.Function):
    """``big * small`` where ``small`` broadcasts over ``big`` (a squeeze-excitation gate, a
    per-channel scale): ``big`` is kept rounded at ``bits`` for ``small``'s gradient, a sum of
    ``grad * big`` (linear in it); ``small`` stays exact, as in eager (its noise would repeat
    along every broadcast dim)."""

    @staticmethod
    def forward(ctx, big, small, bits: int, group_size: int):
        order = memory_order(big)
        ctx.meta = (big.shape, big.dtype, order, bits, group_size, small.shape)
        ctx.save_for_backward(small, *pack(in_memory_order(big, order), bits, group_size))
        return big * small

    @staticmethod
    def backward(ctx, grad):
        shape, dtype, order, bits, group_size, small_shape = ctx.meta
        small, *packed = ctx.saved_tensors
        g_big = (grad * small).to(dtype) if ctx.needs_input_grad[0] else None
        g_small = None
        if ctx.needs_input_grad[1]:
            big = unpack(packed, bits, shape, grad.dtype, group_size, order=order)
            g_small = (grad * big).sum_to_size(small_shape).to(small.dtype)
        return g_big, g_small, None, None


_SELU_ALPHA, _SELU_SCALE = 1.6732632423543772848170429916717, 1.0507009873554804934193349852946


def _gelu_derivative(approximate: str):
    if approximate == "tanh":
        def tanh_form(x):
            c = math.sqrt(2 / math.pi)
            inner = c * (x + 0.044715 * x**3)
            t = torch.tanh(inner)
            return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * c * (1 + 3 * 0.044715 * x * x)
        return tanh_form

    def erf_form(x):
        return (0.5 * (1 + torch.erf(x * (1 / math.sqrt(2))))
                + x * torch.exp(-0.5 * x * x) * (1 / math.sqrt(2 * math.pi)))
    return erf_form


def _silu_derivative(x):
    s = torch.sigmoid(x)
    return s * (1 + x * (1 - s))


#: name -> (function, its derivative of the input, and bounds of that derivative: the grid it
#: is rounded on, fixed, so that packing is one pass with no statistics)
DERIVATIVES = {
    "gelu": (F.gelu, _gelu_derivative("none"), -0.1290, 1.1290),
    "gelu_tanh": (lambda x: F.gelu(x, approximate="tanh"), _gelu_derivative("tanh"),
                  -0.1290, 1.1290),
    "silu": (F.silu, _silu_derivative, -0.0999, 1.0999),
    # (2x + 3) / 6 inside [-3, 3], 0 below, 1 above
    "hardswish": (F.hardswish, lambda x: torch.ops.aten.hardswish_backward(
        torch.ones_like(x), x), -0.5, 1.5),
    "mish": (F.mish, lambda x: torch.ops.aten.mish_backward(torch.ones_like(x), x), -0.1126,
             1.0885),
    # at their default parameters (the handlers check them): derivatives within [0, 1], SELU's
    # within [0, scale * alpha]
    "elu": (F.elu, lambda x: torch.ops.aten.elu_backward(torch.ones_like(x), 1.0, 1, 1, False,
                                                          x), 0.0, 1.0),
    "selu": (F.selu, lambda x: torch.ops.aten.elu_backward(
        torch.ones_like(x), _SELU_ALPHA, _SELU_SCALE, 1, False, x), 0.0,
        _SELU_ALPHA * _SELU_SCALE),
    "softplus": (F.softplus, lambda x: torch.ops.aten.softplus_backward(torch.ones_like(x), x,
                                                                        1.0, 20.0), 0.0, 1.0),
    "logsigmoid": (F.logsigmoid, lambda x: torch.sigmoid(-x), 0.0, 1.0),
    "softsign": (F.softsign, lambda x: (x.abs() + 1).square().reciprocal(), 0.0, 1.0),
    "tanhshrink": (F.tanhshrink, lambda x: torch.tanh(x).square(), 0.0, 1.0),
}


class PackedDerivative(torch.autograd.Function):
    """``f(x)`` for an elementwise ``f`` of :data:`DERIVATIVES`, keeping ``f'(x)`` rounded."""

    @staticmethod
    def forward(ctx, x, name: str, bits: int, group_size: int):
        fn, derivative, low, high = DERIVATIVES[name]
        ctx.meta = (x.shape, bits, low, high)
        ctx.save_for_backward(pack_range(derivative(x.float()), bits, low, high, group_size))
        return fn(x)

    @staticmethod
    def backward(ctx, grad):
        shape, bits, low, high = ctx.meta
        d = unpack_range(ctx.saved_tensors[0], bits, low, high, shape, grad.dtype)
        return grad * d, None, None, None


class DerivativeCodes(torch.autograd.Function):
    """``f(x)`` for an elementwise ``f`` of :data:`DERIVATIVES`, keeping the index of the level
    of ``codebook`` (:class:`actune.packing.codebooks.Codebook`) nearest to ``f'(x)``. Codes and
    levels
    are sums of comparisons, not a search and a gather: pointwise ops a compiler fuses with the
    derivative and the packing, with no index tensor in between."""

    @staticmethod
    def forward(ctx, x, name: str, codebook, group_size: int):
        fn, derivative, _low, _high = DERIVATIVES[name]
        d = derivative(x.float()).reshape(-1)
        codes = sum((d > cut).to(torch.uint8) for cut in codebook.cuts)
        # in whole groups, joined as pack() joins its codes: the statistics tell a compiled
        # graph's saved tensors apart by that shape (traced.packed_origin)
        pad = (-codes.numel()) % group_size
        if pad:
            codes = torch.cat([codes, codes.new_zeros(pad)])
        ctx.meta = (x.shape, codebook)
        ctx.save_for_backward(join_codes(codes.view(-1, group_size), codebook.bits))
        return fn(x)

    @staticmethod
    def backward(ctx, grad):
        shape, codebook = ctx.meta
        codes = split_codes(ctx.saved_tensors[0], codebook.bits).reshape(-1)
        codes = codes[:math.prod(shape)].view(shape)
        levels = codebook.levels
        d = levels[0] + sum((codes > k).to(grad.dtype) * (levels[k + 1] - levels[k])
                            for k in range(len(levels) - 1))
        return grad * d, None, None, None


#: name -> (function of (x, a, b), where its slope is ``high`` (else ``low``), high, low); ``a``
#: and ``b`` are the call's bounds or slope
TWO_SLOPES = {
    "hardtanh": (lambda x, lo, hi: x.clamp(lo, hi), lambda x, lo, hi: (x > lo) & (x < hi),
                 1.0, 0.0),
    "hardsigmoid": (lambda x, _a, _b: F.hardsigmoid(x), lambda x, _a, _b: (x > -3) & (x < 3),
                    1 / 6, 0.0),
    "leaky_relu": (lambda x, slope, _b: F.leaky_relu(x, slope), lambda x, _s, _b: x > 0, 1.0,
                   None),
}


class TwoSlopes(torch.autograd.Function):
    """A piecewise-linear activation of :data:`TWO_SLOPES` keeping one bit per element: where
    its slope is the higher one (leaky ReLU's low slope is its argument ``a``)."""

    @staticmethod
    def forward(ctx, x, name: str, a: float, b: float):
        fn, where, high, low = TWO_SLOPES[name]
        mask = where(x, a, b)
        ctx.meta = (x.shape, memory_order(mask), high, a if low is None else low)
        ctx.save_for_backward(pack_bits(mask))
        return fn(x, a, b)

    @staticmethod
    def backward(ctx, grad):
        shape, order, high, low = ctx.meta
        mask = unpack_bits(ctx.saved_tensors[0], shape, order)
        return torch.where(mask, grad * high, grad * low), None, None, None


class PackedNorm(torch.autograd.Function):
    """Layer norm (``rms=False``) or RMS norm over the last ``dims`` dims, keeping the
    normalised input rounded and ``rstd`` exact."""

    @staticmethod
    def forward(ctx, x, weight, bias, dims: int, eps: float, rms: bool, bits: int,
                group_size: int):
        axes = tuple(range(-dims, 0))
        xf = x.float()
        if rms:
            rstd = torch.rsqrt(xf.square().mean(axes, keepdim=True) + eps)
            xhat = xf * rstd
        else:
            mean = xf.mean(axes, keepdim=True)
            rstd = torch.rsqrt((xf - mean).square().mean(axes, keepdim=True) + eps)
            xhat = (xf - mean) * rstd
        y = xhat
        if weight is not None:
            y = y * weight.float()
        if bias is not None:
            y = y + bias.float()
        ctx.meta = (x.shape, x.dtype, dims, rms, bits, group_size, weight is not None)
        ctx.save_for_backward(rstd, *(() if weight is None else (weight,)),
                              *pack(xhat, bits, group_size, True))
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        shape, dtype, dims, rms, bits, group_size, has_weight = ctx.meta
        rstd, *rest = ctx.saved_tensors
        weight = rest.pop(0) if has_weight else None
        xhat = unpack(tuple(rest), bits, shape, torch.float32, group_size, True)
        axes = tuple(range(-dims, 0))
        lead = tuple(range(grad.dim() - dims))
        g = grad.float()
        gw_ = g * weight.float() if weight is not None else g
        inner = (gw_ * xhat).mean(axes, keepdim=True)
        gx = gw_ - xhat * inner if rms else gw_ - gw_.mean(axes, keepdim=True) - xhat * inner
        gx = (gx * rstd).to(dtype) if ctx.needs_input_grad[0] else None
        gweight = (g * xhat).sum(lead).to(weight.dtype) if ctx.needs_input_grad[1] else None
        gbias = g.sum(lead).to(dtype) if ctx.needs_input_grad[2] else None
        return gx, gweight, gbias, None, None, None, None, None


class TwoCopySoftmax(torch.autograd.Function):
    """Softmax keeping two independently rounded copies of its output: the backward
    ``y1 * (g - sum(g * y2))`` is then unbiased although it is quadratic in ``y``. Returns
    the output and the first copy's three packed tensors (not differentiable), which a
    product reading the output keeps instead of a third copy (:func:`shared_copy`)."""

    @staticmethod
    def forward(ctx, x, dim: int, bits: int, group_size: int):
        y = torch.softmax(x, dim)
        ctx.meta = (y.shape, y.dtype, dim, bits, group_size)
        first = pack(y, bits, group_size)
        ctx.save_for_backward(*first, *pack(y, bits, group_size))
        ctx.mark_non_differentiable(*(t for t in first if t is not None))
        return (y, *first)

    @staticmethod
    def backward(ctx, grad, *_packed):
        shape, _dtype, dim, bits, group_size = ctx.meta
        s = ctx.saved_tensors
        y1 = unpack(s[:3], bits, shape, grad.dtype, group_size)
        y2 = unpack(s[3:], bits, shape, grad.dtype, group_size)
        return y1 * (grad - softmax_shift(grad, y2, dim)), None, None, None


#: the attribute by which a traced softmax's output carries its first packed copy
_SHARED = "_actune_packed_copy"


def softmax_sharing_copy(x: torch.Tensor, dim: int, bits: int, group_size: int) -> torch.Tensor:
    """:class:`TwoCopySoftmax`'s output, carrying its first copy for :func:`shared_copy` (a
    Python attribute of the tensor, which Dynamo traces: nothing leaves the graph for it)."""
    y, *first = TwoCopySoftmax.apply(x, dim, bits, group_size)
    setattr(y, _SHARED, (bits, group_size, tuple(first)))
    return y


def carry_copy(source: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out``, equal to ``source`` (a dropout that drops nothing), carrying its packed copy."""
    kept = getattr(source, _SHARED, None)
    if kept is not None and out is not source:
        setattr(out, _SHARED, kept)
    return out


def shared_copy(t: torch.Tensor, bits: int, group_size: int) -> tuple:
    """The packed copy ``t`` carries at these bits (a traced softmax's output), or ``()``.
    In eager a softmax's first copy serves the product that reads its output; so it does
    here: one pack and one unpack of the attention map fewer a layer (docs/benchmarks.md,
    "torch.compile")."""
    kept = getattr(t, _SHARED, None)
    return kept[2] if kept is not None and kept[:2] == (bits, group_size) else ()
