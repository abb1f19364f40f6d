"""Norms: batch, layer, group, instance and RMS norm; vector 2-norms, ``F.normalize`` and
``F.cosine_similarity``.

Their backward reads the saved input linearly once the statistics (mean, rstd) are fixed, and
the statistics nonlinearly: only the tensor of the input's shape is rounded (``other_bits``);
the per-row or per-channel statistics are small and stay exact, the weight, bias and running
statistics stay references. Large training-mode batch norms in float32/64 run
:class:`~actune.substitutes.lean_batch_norm.LeanBatchNorm` (two activation-sized tensors in
backward, not three;
optionally writing over a convolution's output that nothing else reads).

The bias this leaves is of order (rounding variance) / (elements reduced over): invisible at
the sizes of real layers (docs/training.md). A vector 2-norm reads its input linearly too
once its result is fixed; ``F.normalize`` reads it twice (``x <g, x>``), so it keeps two
independently rounded copies. A cosine similarity is the sum of two normalised inputs'
product, taken as that before its inputs are broadcast against each other.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812

from actune import tunables
from actune.autoprec.allocator import relayed_by_norm
from actune.packing.saved import check_double_backward, take
from actune.rules.activations import compressible
from actune.rules.registry import register
from actune.substitutes.functions import LeanBatchNorm, arg, autocast_dtype, reduced_count

_KEEPS = "input rounded at other bits; statistics exact"
_FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)

_SHARED = ("normalised input rounded at other bits, in groups along its tokens, one feature "
           "each; rstd exact; a matmul reading the output rebuilds it from that copy")


# (torch's own spellings too: the same arguments in the same places, and a call of one runs
# through the function mode without torch.nn.functional's Python dispatch)
@register((F.layer_norm, torch.layer_norm), "norm", "other", _SHARED, only_input_shape=True,
          features_last=True)
def layer_norm(s, func, args, kwargs, level):
    """Layer norm keeping one rounded copy of its normalised input for its own backward and
    for the matmul that reads its output (:class:`SharedNorm`)."""
    return _shared(s, args[0], arg(args, kwargs, 1, "normalized_shape", None),
                   arg(args, kwargs, 2, "weight", None), arg(args, kwargs, 3, "bias", None),
                   arg(args, kwargs, 4, "eps", 1e-5), False, level)


@register((F.rms_norm, torch.rms_norm), "norm", "other", _SHARED, only_input_shape=True,
          features_last=True)
def rms_norm(s, func, args, kwargs, level):
    """RMS norm, as :func:`layer_norm` (``eps=None``: the dtype's machine epsilon)."""
    x = args[0]
    eps = arg(args, kwargs, 3, "eps", None)
    if eps is None and isinstance(x, torch.Tensor) and x.is_floating_point():
        eps = torch.finfo(x.dtype).eps
    return _shared(s, x, arg(args, kwargs, 1, "normalized_shape", None),
                   arg(args, kwargs, 2, "weight", None), None, eps, True, level)


def _shared(s, x, shape, weight, bias, eps, rms: bool, level):
    if (not compressible(x, level) or x.dtype not in _FLOATS or shape is None
            or not isinstance(eps, float | int)
            or any(t is not None and (not isinstance(t, torch.Tensor) or t.dtype != x.dtype)
                   for t in (weight, bias))):
        return None
    shape = (int(shape),) if isinstance(shape, int) else tuple(shape)
    held: list = []
    if autocast_dtype(x.device.type) is None:
        out = SharedNorm.apply(x, weight, bias, shape, float(eps), rms, s, held)
    elif x.dtype == torch.float32:
        # under autocast a norm of float32 tensors runs in float32, as here; a matmul
        # reading its output saves autocast's copy of it, rebuilt from the same packed x_hat
        # (Session.derive). A 16-bit input: each device's policy casts it its own way
        with torch.autocast(x.device.type, enabled=False):
            out = SharedNorm.apply(x, weight, bias, shape, float(eps), rms, s, held)
    else:
        return None
    saved = held[0]
    ap = s.allocating
    if ap is not None and saved.slot is not None:  # x_hat's noise is relative: unscaled
        relays = ap.watch([saved.slot], out, 1.0, relayed=True, reach_all=False)
        if ap.collecting:  # (scaled in backward by what the norm passes on)
            out.grad_fn.relays = relays
    s.derive(out, saved, weight, bias)
    return out


def shared_width(level) -> int:
    """The bits of a norm's shared copy without an allocator: at a mixed-precision level (L3:
    ``avg_bits``) the bytes of the two copies it replaces, spent on one (2 x 2 -> 4 bits), as
    the allocator's first statistics step does; at a uniform level (``u2``, L2) its width."""
    bits = level.other_bits
    return min(2 * bits, 8) if level.avg_bits is not None else bits


class SharedNorm(torch.autograd.Function):
    """Layer or RMS norm saving its normalised input ``x_hat``, rounded in groups along the
    tokens (one feature each), instead of its input: its backward reads ``x_hat`` (linearly,
    with ``rstd`` exact), and its output ``x_hat * weight + bias`` can be rebuilt from the same
    copy by the matmul that reads it (:meth:`actune.session.hooks.Session.derive`), so the pair
    keeps
    one packed tensor where PyTorch keeps two. Under an allocator that slot counts twice in the
    budget: the same bytes as two 2-bit copies, spent on one."""

    @staticmethod
    def forward(ctx, x, weight, bias, shape, eps, rms, session, held):
        if rms:  # (statistics in float32 at least, as Hugging Face's RMSNorm computes them)
            wide = x if x.dtype in (torch.float32, torch.float64) else x.float()
            dims = tuple(range(x.dim() - len(shape), x.dim()))
            rstd = torch.rsqrt(wide.square().mean(dims, keepdim=True).add_(eps))
            x_hat = (wide * rstd).to(x.dtype)
            out = x_hat if weight is None else x_hat * weight
        else:
            out, mean, rstd = torch.native_layer_norm(x, shape, weight, bias, eps)
            x_hat = (x - mean).mul_(rstd).to(x.dtype)
        saved = session.packer.pack_value(x_hat, shared_width(session.level), "norm",
                                          replaces=(x,), reads=False, by_feature=True)
        del x_hat
        held.append(saved)
        ctx.x_hat, ctx.shape, ctx.rms = saved, shape, rms
        ctx.save_for_backward(rstd, weight, bias)  # (rstd: kept exact by the hooks)
        return out

    @staticmethod
    def backward(ctx, grad):
        check_double_backward()
        rstd, weight, bias = ctx.saved_tensors
        x_hat = take(ctx, "x_hat").get()
        needs = ctx.needs_input_grad
        relays = getattr(ctx, "relays", None)
        if relays:  # (a statistics step of the bit allocator)
            relayed_by_norm(relays, grad, x_hat, weight, len(ctx.shape))
        if ctx.rms:
            dx, dw = _rms_backward(grad, x_hat, rstd, weight, len(ctx.shape),
                                   needs[1] and weight is not None)
            return dx, dw, None, None, None, None, None, None
        # PyTorch's backward of x_hat itself (mean 0, rstd 1), then scaled by the true rstd
        dx, dw, db = torch.ops.aten.native_layer_norm_backward(
            grad, x_hat, list(ctx.shape), torch.zeros_like(rstd), torch.ones_like(rstd),
            weight, bias, [needs[0], needs[1] and weight is not None,
                           needs[2] and bias is not None])
        if dx is not None:
            dx = dx.mul_(rstd) if dx.dtype == rstd.dtype else (dx * rstd).to(dx.dtype)
        return dx, dw, db, None, None, None, None, None


def _rms_backward(grad, x_hat, rstd, weight, ndims: int, weight_grad: bool):
    """``rstd * (g w - x_hat * mean(g w x_hat))`` and (``weight_grad``) ``sum g x_hat``, in
    ``rstd``'s dtype."""
    dims = tuple(range(grad.dim() - ndims, grad.dim()))
    lead = tuple(range(grad.dim() - ndims))
    g, xh = grad.to(rstd.dtype), x_hat.to(rstd.dtype)
    if weight is not None and ndims == 1:  # (the common case: fewer passes, no mean's temporary)
        w = weight.to(rstd.dtype)
        gx = g * xh
        dot = torch.matmul(gx, w).div_(w.numel()).unsqueeze(-1)  # mean(g w x_hat)
        dx = (g * w).addcmul_(xh, dot, value=-1).mul_(rstd).to(grad.dtype)
        return dx, gx.sum(lead).to(weight.dtype) if weight_grad else None
    gw = g if weight is None else g * weight.to(rstd.dtype)
    dx = (gw - xh * (gw * xh).mean(dims, keepdim=True)).mul_(rstd).to(grad.dtype)
    dw = (g * xh).sum(lead).to(weight.dtype) if weight_grad else None
    return dx, dw


# (torch's own spellings too: the rule names no argument by place, and torch.batch_norm's
# differ from F.batch_norm's, so it takes this rule, not the lean substitute's)
register((F.group_norm, F.instance_norm, torch.group_norm, torch.instance_norm,
          torch.batch_norm), "norm", "other", _KEEPS, only_input_shape=True)(None)


def _features_last(args: tuple) -> bool:
    """Is a batch norm's input ``[batch, features]`` (BatchNorm1d after a linear layer, as
    LeViT's and a classifier head's): normalised per feature over the batch, so each group
    holds one feature's values, not a row of features with different offsets."""
    return isinstance(args[0], torch.Tensor) and args[0].dim() == 2


@register((F.batch_norm,), "norm", "other", _KEEPS + " (a [batch, features] input by "
          "feature); large ones backward in place", only_input_shape=True,
          features_last_if=_features_last)
def lean_batch_norm(s, func, args, kwargs, level):
    """A large training-mode batch norm runs :class:`LeanBatchNorm`."""
    if level.other_bits is None:
        return None
    norm = _lean_norm_args(s, args, kwargs)
    if norm is None:
        return None
    out = LeanBatchNorm.apply(*norm, s.pack_hook)
    if out is norm[0]:  # overwritten: a new value, in its own storage in PyTorch
        s.accounting.forget(out)
    return out


def _lean_norm_args(s, args, kwargs) -> tuple | None:
    """(x, weight, bias, running_mean, running_var, momentum, eps, overwrite) of a training-mode
    batch norm that :class:`LeanBatchNorm` should run, or None (PyTorch's own: small inputs,
    half precision, autocast)."""
    x = args[0]
    if x.numel() < tunables.LEAN_NUMEL:
        return None
    weight, bias = arg(args, kwargs, 3, "weight", None), arg(args, kwargs, 4, "bias", None)
    momentum = arg(args, kwargs, 6, "momentum", 0.1)
    if (not arg(args, kwargs, 5, "training", False) or x.dim() < 2
            or x.dtype not in (torch.float32, torch.float64)
            or autocast_dtype(x.device.type) is not None or not isinstance(momentum, float | int)
            or any(t is not None and t.dtype != x.dtype for t in (weight, bias))):
        return None
    ap = s.allocating
    overwrite = (s.overwritable.pop(x, False) and not x.is_leaf and x._base is None
                 and not (ap is not None and ap.collecting))  # statistics read the input after
    return (x, weight, bias, arg(args, kwargs, 1, "running_mean", None),
            arg(args, kwargs, 2, "running_var", None), float(momentum),
            float(arg(args, kwargs, 7, "eps", 1e-5)), overwrite)


# -- vector norms and F.normalize -----------------------------------------------------------

#: Vector norms, with where their order is passed and its default: the 2-norm's backward,
#: ``grad * x / norm``, reads the input linearly once the norm (small, exact) is fixed.
VECTOR_NORMS = {
    torch.linalg.vector_norm: ("ord", 2),
    torch.norm: ("p", "fro"),
    torch.Tensor.norm: ("p", "fro"),
    torch.linalg.norm: ("ord", None),  # (None: the 2-norm of a vector, Frobenius of a matrix)
}


def _is_two_norm(func, order, x: torch.Tensor, dim) -> bool:
    """Is ``order`` the 2-norm of the elements reduced (Frobenius is; linalg.norm's ``ord=2``
    is a vector's 2-norm over one dim, over two the spectral norm, which is not)?"""
    if order is None or order == "fro":
        return func is torch.linalg.norm or order == "fro"
    if isinstance(order, bool) or not isinstance(order, int | float) or order != 2:
        return False
    return func is not torch.linalg.norm or isinstance(dim, int) or (dim is None
                                                                     and x.dim() == 1)


@register(tuple(VECTOR_NORMS), "norm", None,
          "2-norm: input rounded at other bits (backward grad * x / norm, linear in x), the "
          "norm exact; other orders exact", only_input_shape=True)
def vector_norm(s, func, args, kwargs, level):
    """A 2-norm (ConvNeXt V2's global response norm) saves its input, rounded; its result, a
    reduction, stays exact (as a norm's statistics do)."""
    x = args[0]
    name, default = VECTOR_NORMS[func]
    dim = arg(args, kwargs, 2, "dim", None)
    if (compressible(x, level) and kwargs.get("out") is None
            and _is_two_norm(func, arg(args, kwargs, 1, name, default), x, dim)
            and reduced_count(x, dim) > 1):
        # (a reduction over one element is |x|: its result has the input's shape and reads
        # it nonlinearly; the rule's own width, None, keeps it exact)
        return s.run_as("other", func, args, kwargs)
    return None


#: Variances and standard deviations (a hand-written layer norm's ``x.std(-1)``).
SPREADS = (torch.var, torch.std, torch.var_mean, torch.std_mean, torch.Tensor.var,
           torch.Tensor.std)


@register(SPREADS, "norm", None,
          "input rounded at other bits (backward 2 (x - mean(x)) / (n - correction), linear "
          "in x; a standard deviation's divided by its result), the result exact",
          only_input_shape=True)
def spread(s, func, args, kwargs, level):
    """``var`` / ``std`` (and their ``_mean`` forms) save their input, rounded: the backward
    is linear in it, the mean subtracted there read from the same rounded values; the
    result, a reduction, stays exact (as a norm's statistics do)."""
    x = args[0]
    dim = arg(args, kwargs, 1, "dim", None)
    if isinstance(dim, bool):  # (the legacy ``std(x, unbiased)``: over every element)
        dim = None
    if (compressible(x, level) and kwargs.get("out") is None and x.is_floating_point()
            and reduced_count(x, dim) > 1):
        return s.run_as("other", func, args, kwargs)
    return None


@register((F.normalize,), "norm", None,
          "p=2: two independently rounded copies of the input at the level's sensitive bits, "
          "the norm exact (backward grad / n - x <grad, x> / n**3, linear in each copy); "
          "other p exact")
def normalize(s, func, args, kwargs, level):
    """``F.normalize`` at p=2 (Swin V2's cosine attention, CLIP-style embeddings) runs
    :class:`NormalizeTwoCopies` at the level's sensitive width (its copies' noise reaches
    attention's scores: at 2 bits Swin V2's gradient noise grew by a sixth, at 4 it stays as
    with the input exact; docs/training.md). Any other call runs as PyTorch's, exact, as does
    a leaf or a view of one (a weight normalised in forward, a cosine classifier's: what
    PyTorch saves of it is a reference, where copies would add bytes and noise)."""
    x = args[0]
    p = arg(args, kwargs, 1, "p", 2.0)
    dim = arg(args, kwargs, 2, "dim", 1)
    eps = arg(args, kwargs, 3, "eps", 1e-12)
    if (not compressible(x, level) or arg(args, kwargs, 4, "out", None) is not None
            or x.is_leaf or (x._base is not None and x._base.is_leaf)
            or isinstance(p, bool) or not isinstance(p, int | float) or p != 2
            or isinstance(eps, bool) or not isinstance(eps, int | float)
            or not isinstance(dim, int | tuple | list)):
        return None
    return NormalizeTwoCopies.apply(x, dim if isinstance(dim, int) else tuple(dim), float(eps),
                                    level.sensitive_width, s)


#: The attribute :class:`NormalizeTwoCopies` sets on its output: a tensor of unit vectors.
_UNIT = "_actune_unit_vectors"


def unit_vectors(t: torch.Tensor) -> bool:
    """Is ``t`` (or the tensor it is a view of: a transposed key) ``F.normalize``'s output?
    A product of two such tensors (cosine attention's scores, a contrastive loss's
    similarities) reads its operands' rounding noise against the small differences between
    unit vectors: the routing gives it the level's sensitive width."""
    base = t._base
    return getattr(t if base is None else base, _UNIT, False)


@register((F.cosine_similarity, torch.cosine_similarity), "norm", None,
          "each input normalised before broadcasting (the normalize rule), their product's "
          "operands rounded (the product rule); PyTorch keeps tensors of the broadcast shape")
def cosine_similarity(s, func, args, kwargs, level):
    """``F.cosine_similarity(x1, x2, dim)`` is PyTorch's composite of norms, divisions and a
    product over its inputs broadcast against each other: a contrastive loss's similarity
    matrix (``x[:, None]`` against ``x[None]``) keeps several tensors of batch x batch x
    features, all exact. It runs as ``(normalize(x1) * normalize(x2)).sum(dim)`` through the
    routing, each input normalised at its own shape (the same values, to the bit, where the
    inputs are not broadcast along ``dim``), so what is kept is the inputs' size, rounded."""
    x1, x2 = args[0], arg(args, kwargs, 1, "x2", None)
    dim, eps = arg(args, kwargs, 2, "dim", 1), arg(args, kwargs, 3, "eps", 1e-8)
    if (not isinstance(x1, torch.Tensor) or not isinstance(x2, torch.Tensor)
            or not x1.is_floating_point() or x1.dtype != x2.dtype or x1.dim() != x2.dim()
            or x1.dim() == 0 or isinstance(dim, bool) or not isinstance(dim, int)
            or isinstance(eps, bool) or not isinstance(eps, int | float)
            or x1.shape[dim] != x2.shape[dim]  # (broadcast along dim: PyTorch's own)
            or max(x1.numel(), x2.numel()) < level.min_numel or level.other_bits is None):
        return None
    with s.routing():  # (the norms routed, as a model's own would be)
        u1, u2 = F.normalize(x1, 2.0, dim, eps), F.normalize(x2, 2.0, dim, eps)
    # unit vectors' product: at the level's sensitive width, as normalize's copies (their
    # noise is large beside the small differences between unit vectors that the gradient of
    # a similarity read by a sharp softmax, a contrastive loss's, is made of)
    return s.run_as("sensitive", torch.mul, (u1, u2), {}).sum(dim)


class NormalizeTwoCopies(torch.autograd.Function):
    """``x / max(|x|, eps)`` along ``dim`` keeping two independently rounded copies of ``x``
    and its norm ``n`` exact (one value per row reduced). Backward is
    ``g / d - [n >= eps] x <g, x> / n**3`` with ``d = max(n, eps)``: the product of ``x`` with
    itself is taken between the two copies, so it stays unbiased where one copy would add its
    rounding variance (as ``x ** 3`` keeps two copies)."""

    @staticmethod
    def forward(ctx, x, dim, eps, bits, session):
        n = torch.linalg.vector_norm(x, 2, dim, keepdim=True)
        # (at the level's sensitive width whatever the bit allocator would choose)
        ctx.x1 = session.packer.pack_fixed(x, bits, "normalize", replaces=(x,))
        ctx.x2 = session.packer.pack_fixed(x, bits, "normalize")
        ctx.n = session.packer.keep_exact(n, "normalize norm")  # (one value a row)
        ctx.conf = (dim, eps)
        y = x / n.clamp_min(eps)
        setattr(y, _UNIT, True)  # (read by the routing's label of a product of two: above)
        return y

    @staticmethod
    def backward(ctx, grad):
        check_double_backward()
        dim, eps = ctx.conf
        n = take(ctx, "n")
        d = n.clamp_min(eps)
        x2 = take(ctx, "x2").get()
        inner = (grad * x2).sum(dim, keepdim=True)
        del x2
        x1 = take(ctx, "x1").fresh()
        scale = torch.where(n >= eps, inner / d.pow(3), torch.zeros_like(inner))
        return grad / d - x1.mul_(scale), None, None, None, None
