"""Elementwise math written inline: products, powers, exp, sqrt, rsqrt, reciprocal, erf, log,
sin, cos; embeddings, gathers and selections; tests of values.

* A product ``a * b`` saves each operand for the other's gradient: linear in each, so they are
  rounded at ``other_bits`` (unbiased). The same holds for ``exp`` (backward ``grad * y``),
  ``x ** 2`` and ``square`` (backward ``2 * grad * x``). An embedding saves its indices: kept
  exact, in the narrowest integer type its table's rows need. So does ``gather``, whose
  backward reads no value of its input (PyTorch keeps the input too), and so do the ops that
  select values along a dimension and return their indices (``topk``, ``sort``, ``max`` and
  ``min`` along a dim, ``kthvalue``, ``median``, ``mode``, ``cummax``, ``cummin``): backward
  scatters the gradient by the indices, which PyTorch keeps in int64.
* Every other op here has a nonlinear backward in what it saves; it saves its derivative,
  rounded and used linearly, instead (GPT-2's ``x ** 3``, RMSNorm's ``rsqrt``, ...).

Additions, subtractions, negation, concatenation, slices, views and casts save nothing. Tests
of values (``isfinite``, ``isclose``) return booleans, which carry no gradient, yet
PyTorch builds them from differentiable ops (``abs``) whose nodes save their input while the
test runs: they run without recording.
"""

from __future__ import annotations

import math
import numbers

import torch
import torch.nn.functional as F  # noqa: N812

from actune.packing.saved import check_double_backward, take
from actune.rules.activations import compressible
from actune.rules.masks import MaskedExtremum, select_of_two
from actune.rules.registry import register
from actune.substitutes.functions import SavedDerivative, arg, index_dtype

register((torch.exp, torch.Tensor.exp, torch.square, torch.Tensor.square),
         "elementwise", "other", "operands rounded at other bits (backward linear in each)")(None)


@register((F.embedding,), "elementwise", "other",
          "indices exact, in the narrowest integer type the table's rows need")
def embedding(s, func, args, kwargs, level):
    """An embedding saves its indices (int64) for the weight's gradient: kept exact in uint8
    up to 256 rows (T5's relative-position buckets), int16 up to 32,768, else int32; the
    table's size bounds them, so no value is read to choose."""
    ids, weight = args[0], arg(args, kwargs, 1, "weight", None)
    padding_idx = arg(args, kwargs, 2, "padding_idx", None)
    if (not isinstance(weight, torch.Tensor) or not weight.requires_grad
            or arg(args, kwargs, 3, "max_norm", None) is not None
            or arg(args, kwargs, 6, "sparse", False) or ids.is_floating_point()
            or ids.numel() < level.min_numel):
        return None
    rows = weight.shape[0]
    if padding_idx is not None and padding_idx < 0:
        padding_idx += rows
    return CompactEmbedding.apply(weight, ids, -1 if padding_idx is None else padding_idx,
                                  bool(arg(args, kwargs, 5, "scale_grad_by_freq", False)), s)


class CompactEmbedding(torch.autograd.Function):
    """``F.embedding`` keeping its indices in the narrowest integer type (see
    :func:`embedding`); its backward is PyTorch's."""

    @staticmethod
    def forward(ctx, weight, ids, padding_idx, scale_grad_by_freq, session):
        rows = weight.shape[0]
        ctx.ids = session.packer.pack_small_ints(ids, "embedding indices", (ids,),
                                                 index_dtype(rows))
        ctx.conf = (rows, padding_idx, scale_grad_by_freq)
        return F.embedding(ids, weight, None if padding_idx < 0 else padding_idx)

    @staticmethod
    def backward(ctx, grad):
        check_double_backward()
        rows, padding_idx, scale_grad_by_freq = ctx.conf
        ids = take(ctx, "ids").get().long()
        return (torch.ops.aten.embedding_dense_backward(grad, ids, rows, padding_idx,
                                                        scale_grad_by_freq),
                None, None, None, None)


@register((torch.gather, torch.Tensor.gather), "elementwise", None,
          "indices exact, in the narrowest integer type the gathered dimension needs; the "
          "input not kept (its gradient reads only its shape)")
def gather(s, func, args, kwargs, level):
    """``torch.gather(x, dim, index)`` saves ``x`` and the int64 ``index`` (ViTMAE's token
    shuffles, an ``index`` repeated over the features); its backward scatters the gradient
    by the index and reads no value of ``x``. Kept: the index, in uint8 up to 256 positions,
    int16 up to 32,768, else int32 (``x``'s size along ``dim`` bounds it: no value read)."""
    x = args[0]
    dim, index = arg(args, kwargs, 1, "dim", None), arg(args, kwargs, 2, "index", None)
    if (not isinstance(x, torch.Tensor) or not isinstance(index, torch.Tensor)
            or not isinstance(dim, int) or index.dtype != torch.int64
            or arg(args, kwargs, 3, "sparse_grad", False) or "out" in kwargs
            or index.numel() < level.min_numel or x.dim() == 0):
        return None
    return CompactGather.apply(x, dim % x.dim(), index, s)


class CompactGather(torch.autograd.Function):
    """``torch.gather`` keeping only its index, in the narrowest integer type (see
    :func:`gather`); its backward is PyTorch's (a scatter-add of the gradient)."""

    @staticmethod
    def forward(ctx, x, dim, index, session):
        ctx.index = session.packer.pack_small_ints(index, "gather indices", (index, x),
                                                   index_dtype(x.shape[dim]))
        ctx.conf = (dim, x.shape, x.dtype)
        return torch.gather(x, dim, index)

    @staticmethod
    def backward(ctx, grad):
        check_double_backward()
        dim, shape, dtype = ctx.conf
        index = take(ctx, "index").get().long()
        out = torch.zeros(shape, dtype=dtype, device=grad.device)
        return out.scatter_add_(dim, index, grad.to(dtype)), None, None, None


#: function name -> (position, default) of the dimension a selection runs along, and of its
#: ``keepdim`` (None: the values keep the dimension: ``topk``, ``sort``, the running ones).
_SELECTIONS = {"topk": ((2, -1), None), "sort": ((1, -1), None), "kthvalue": ((2, -1), (3, False)),
               "median": ((1, None), (2, False)), "mode": ((1, -1), (2, False)),
               "max": ((1, None), (2, False)), "min": ((1, None), (2, False)),
               "cummax": ((1, None), None), "cummin": ((1, None), None)}


def selection_dim(func, args, kwargs) -> tuple[int, bool] | None:
    """The dimension a selection call runs along and whether its values keep it, or None
    where the call is another form (``max(x)``, ``max(x, other)``, ``median(x)``)."""
    (at, default), keep = _SELECTIONS[func.__name__]
    dim = arg(args, kwargs, at, "dim", default)
    if isinstance(dim, bool) or not isinstance(dim, int):
        return None
    if keep is None:
        return dim, True
    keepdim = arg(args, kwargs, keep[0], "keepdim", keep[1])
    return (dim, keepdim) if isinstance(keepdim, bool) else None


@register(tuple(f for name in _SELECTIONS for f in (getattr(torch, name),
                                                     getattr(torch.Tensor, name))),
          "elementwise", None,
          "along a dim: the indices exact, in the narrowest integer type the dimension needs "
          "(the values' gradient scattered by them); other forms exact")
def selection(s, func, args, kwargs, level):
    """``torch.topk``, ``sort``, ``max(x, dim)``... return values and int64 indices, and keep
    the indices (``cummax`` the input too) for a backward that scatters the values' gradient
    by them. Kept: the indices in uint8 up to 256 positions along the dim, int16 up to
    32,768, else int32 (the dim's size bounds them). ``max(x, other)`` and ``min(x, other)``
    run as ``maximum`` and ``minimum`` (:mod:`actune.rules.masks`)."""
    x = args[0]
    if func.__name__ in ("max", "min") and isinstance(arg(args, kwargs, 1, "other", None),
                                                      torch.Tensor):
        return select_of_two(s, torch.maximum if func.__name__ == "max" else torch.minimum,
                             args, kwargs, level)
    found = selection_dim(func, args, kwargs)
    if found is None and func.__name__ in ("max", "min") and len(args) == 1 and not kwargs:
        # over every element: a mask of where the input equals the result
        if (level.masks and isinstance(x, torch.Tensor) and x.is_floating_point()
                and x.dim() > 0 and x.numel() >= level.min_numel):
            return MaskedExtremum.apply(x, func.__name__ == "max", tuple(range(x.dim())),
                                        False, True, s)
        return None
    if (found is None or not isinstance(x, torch.Tensor) or x.dim() == 0
            or "out" in kwargs or x.numel() < level.min_numel):
        return None
    dim, keepdim = found
    values, indices = CompactSelection.apply(x, func, args[1:], kwargs, dim % x.dim(), keepdim,
                                             s)
    return getattr(torch.return_types, func.__name__)((values, indices))


class CompactSelection(torch.autograd.Function):
    """A selection along ``dim`` keeping only its indices, in the narrowest integer type (see
    :func:`selection`); backward scatters the values' gradient by them, as PyTorch's does."""

    @staticmethod
    def forward(ctx, x, func, rest, kwargs, dim, keepdim, session):
        values, indices = func(x, *rest, **kwargs)
        ctx.mark_non_differentiable(indices)
        # (a running maximum's backward reads its input too, for its shape)
        replaces = (indices, x) if func.__name__.startswith("cum") else (indices,)
        ctx.indices = session.packer.pack_small_ints(indices, "selection indices", replaces,
                                                     index_dtype(x.shape[dim]))
        ctx.conf = (dim, keepdim, x.shape, x.dtype)
        return values, indices

    @staticmethod
    def backward(ctx, grad, _grad_indices):
        check_double_backward()
        dim, keepdim, shape, dtype = ctx.conf
        indices = take(ctx, "indices").get().long()
        if not keepdim:
            grad, indices = grad.unsqueeze(dim), indices.unsqueeze(dim)
        out = torch.zeros(shape, dtype=dtype, device=grad.device)
        # (scatter_add: a running maximum repeats its index; the others' are distinct)
        return out.scatter_add_(dim, indices, grad.to(dtype)), None, None, None, None, None, None


@register((torch.isfinite, torch.Tensor.isfinite, torch.isclose, torch.Tensor.isclose),
          "elementwise", None, "nothing: a boolean result, computed without recording")
def value_test(s, func, args, kwargs, level):
    """A test of values (a loss's ``isfinite`` check, a matcher's ``isclose``): its boolean
    result has no gradient, but ``abs`` inside it saves its input for a backward that never
    comes (counted as kept, and held until the test returns); run without recording."""
    with torch.no_grad():
        return func(*args, **kwargs)


@register((torch.mul, torch.Tensor.mul, torch.Tensor.__mul__, torch.Tensor.__rmul__,
           torch.Tensor.mul_, torch.Tensor.__imul__, torch.multiply, torch.Tensor.multiply,
           torch.Tensor.multiply_), "elementwise", "other",
          "operands rounded at other bits (backward linear in each); an operand broadcast "
          "over the other (rotary cos/sin, RMSNorm's rstd, a mask) exact")
def product(s, func, args, kwargs, level):
    """``a * b``: each operand is saved for the other's gradient and rounded, except one
    broadcast over the other's shape. Its rounding noise would repeat along every broadcast
    dim (the same rotary table for every sample and head, one ``rstd`` for a token's
    features): shared, not averaged, by the gradients it multiplies; and it is the smaller
    tensor by the broadcast factor. Two activations of one shape (SwiGLU's ``act(gate) * up``)
    run :class:`GatedProduct`."""
    a, b = args[0], arg(args, kwargs, 1, "other", None)
    if not isinstance(b, torch.Tensor):
        return None
    if a.shape != b.shape:
        n = max(a.numel(), b.numel())
        s.label.exact_ids = {id(t): "broadcast operand" for t in (a, b) if t.numel() < n}
        return None  # the op as it is; the hooks pack the rest at other bits
    if (func in _OUT_OF_PLACE and len(args) + len(kwargs) == 2 and a.requires_grad
            and b.requires_grad and compressible(a, level) and a.dtype == b.dtype):
        held: list = []
        out = GatedProduct.apply(a, b, level.sensitive_width, s, held)
        s.derive(out, held[0], None, None, factor=held[1])
        return out
    return None


@register((torch.div, torch.Tensor.div, torch.Tensor.__truediv__, torch.Tensor.div_,
           torch.Tensor.__itruediv__, torch.divide, torch.Tensor.divide, torch.true_divide,
           torch.Tensor.true_divide), "elementwise", "other",
          "the dividend rounded at other bits (the divisor's gradient -g a / b**2 is linear "
          "in it), the divisor exact (read as 1 / b and 1 / b**2); a dividend broadcast over "
          "the divisor exact")
def quotient(s, func, args, kwargs, level):
    """``a / b`` with a tensor ``b``: PyTorch keeps ``b`` (for ``g / b``) and, where ``b``
    needs a gradient, ``a``. Only ``a`` enters a gradient linearly: it is rounded (a
    hand-written layer norm's centred input over its standard deviation), unless broadcast
    over ``b`` (its one noise would repeat, as a product's broadcast operand's)."""
    a, b = args[0], arg(args, kwargs, 1, "other", None)
    if not isinstance(b, torch.Tensor) or kwargs.get("rounding_mode") is not None:
        return None  # (by a number: nothing saved; rounded quotients: no gradient)
    exact = {id(b): "divisor"}
    if isinstance(a, torch.Tensor) and a.numel() < b.numel():
        exact[id(a)] = "broadcast dividend"
    s.label.exact_ids = exact
    return None  # the op as it is; the hooks pack the dividend at other bits


_OUT_OF_PLACE = frozenset({torch.mul, torch.Tensor.mul, torch.Tensor.__mul__,
                           torch.Tensor.__rmul__, torch.multiply, torch.Tensor.multiply})


class GatedProduct(torch.autograd.Function):
    """``a * b`` of two activations (a gated MLP's ``act(gate) * up``), keeping each operand
    rounded at the level's ``sensitive_bits`` (4 at L3), in groups along the tokens, one
    feature each, independently. Each operand's noise multiplies the other's whole gradient,
    and these are activations (heavy-tailed, unlike a bounded derivative), so 2 bits there
    cost a gated model several times the gradient noise of the rest
    (docs/training.md). The matmul reading the product (the down projection) rebuilds it
    from the two copies (``Derived``): three tensors cost two 4-bit copies, not three 2-bit
    ones and a far noisier gradient. Unbiased: each gradient is linear in each copy, and the
    copies are independent."""

    @staticmethod
    def forward(ctx, a, b, bits, session, held):
        ctx.a = session.packer.pack_fixed(a, bits, "product", replaces=(a,), by_feature=True)
        ctx.b = session.packer.pack_fixed(b, bits, "product", replaces=(b,), by_feature=True)
        held.extend((ctx.a, ctx.b))
        return a * b

    @staticmethod
    def backward(ctx, grad):
        check_double_backward()
        needs = ctx.needs_input_grad
        a, b = take(ctx, "a"), take(ctx, "b")
        return (_times(grad, b) if needs[0] else None, _times(grad, a) if needs[1] else None,
                None, None, None)


def _times(grad: torch.Tensor, saved) -> torch.Tensor:
    """``grad`` times a packed operand: folded into its unpack where the kernels can
    (:meth:`~actune.packing.saved.Saved.folded_times`), else written over its dequantized
    copy where the dtypes agree and nothing else holds that copy (one temporary less)."""
    out = saved.folded_times(grad)
    if out is not None:
        return out
    if saved.held:  # dequantized already, for the other reader
        return saved.get() * grad
    value = saved.fresh()
    return value.mul_(grad) if value.dtype == grad.dtype and value.shape == grad.shape \
        else grad * value

_DERIVATIVE = "derivative rounded at other bits (used linearly)"


def _derivative_rule(funcs, fn, derivative, of_input: bool) -> None:
    """Register ``funcs`` (unary ops) to save ``derivative(x, y)`` instead of ``x`` or ``y``."""

    @register(funcs, "elementwise", None, _DERIVATIVE)
    def rule(s, func, args, kwargs, level):
        x = args[0]
        if len(args) > 1 or kwargs or not compressible(x, level):
            return None  # an out= or other argument: PyTorch's own (exact)
        return SavedDerivative.apply(x, fn, derivative, level.other_bits, s, of_input)


_derivative_rule((torch.sqrt, torch.Tensor.sqrt), torch.sqrt,
                 lambda _x, y: y.reciprocal().mul_(0.5), False)
_derivative_rule((torch.rsqrt, torch.Tensor.rsqrt), torch.rsqrt,
                 lambda _x, y: y.pow(3).mul_(-0.5), False)
_derivative_rule((torch.reciprocal, torch.Tensor.reciprocal), torch.reciprocal,
                 lambda _x, y: y.square().neg_(), False)
_derivative_rule((torch.erf, torch.special.erf, torch.Tensor.erf), torch.erf,
                 lambda x, _y: x.square().neg_().exp_().mul_(2 / math.sqrt(math.pi)), True)
_derivative_rule((torch.log, torch.Tensor.log), torch.log, lambda x, _y: x.reciprocal(), True)
_derivative_rule((torch.sin, torch.Tensor.sin), torch.sin, lambda x, _y: x.cos(), True)
_derivative_rule((torch.cos, torch.Tensor.cos), torch.cos, lambda x, _y: x.sin().neg_(), True)


class CubeTwoCopies(torch.autograd.Function):
    """``x ** 3`` keeping two independently rounded copies of ``x``: the backward
    ``3 g x1 x2`` is unbiased (the copies' noises are independent), and each copy spans the
    range of ``x``, where one rounded ``3 x^2`` would span the square of its outliers."""

    @staticmethod
    def forward(ctx, x, bits, session):
        ctx.x1 = session.packer.pack_value(x, bits, "derivative", replaces=(x,))
        ctx.x2 = session.packer.pack_value(x, bits, "derivative")
        return x.pow(3)

    @staticmethod
    def backward(ctx, grad):
        check_double_backward()
        x1 = take(ctx, "x1").fresh()
        x2 = take(ctx, "x2").get()
        return x1.mul_(x2).mul_(grad).mul_(3), None, None


@register((torch.pow, torch.Tensor.pow, torch.Tensor.__pow__), "elementwise", None,
          "x ** 2: input rounded at other bits (backward linear in it); x ** 3: two rounded "
          "copies of x; other constant exponents: derivative rounded")
def power(s, func, args, kwargs, level):
    x, p = args[0], arg(args, kwargs, 1, "exponent", None)
    if (kwargs or not compressible(x, level) or not isinstance(p, numbers.Real)
            or isinstance(p, bool)):
        return None  # a tensor exponent or base: PyTorch's own (exact)
    if p == 2:
        return s.run_as("other", func, args, kwargs)
    if p == 3:  # GPT-2's gelu_new: 3 x^2 from two copies of x, not x^2 at one's width
        return CubeTwoCopies.apply(x, level.other_bits, s)
    p = float(p)
    return SavedDerivative.apply(x, lambda t: t.pow(p), lambda t, _y: t.pow(p - 1).mul_(p),
                                 level.other_bits, s, True)
