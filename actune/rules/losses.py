"""Losses: ``F.cross_entropy`` over class logits (an LM head's, a segmentation's); the regression
losses and binary cross entropy with logits.

PyTorch's cross entropy keeps the log-probabilities, an exact float copy of the logits' size,
until backward: over a large vocabulary the largest tensor of a small LM's step (Cut
Cross-Entropy, Wijmans et al., 2024). Its gradient, ``(p - target distribution) * weight``, is
linear in the probabilities ``p``: :class:`PackedCrossEntropy` keeps them rounded at the
level's ``sensitive_bits`` (4 at L3: their noise reaches every gradient; unbiased), plus the
targets and per-row weights (small). Its forward works in slices of rows, so the float copies
and exponentials it needs are a slice's size, not the logits'. ``log_softmax`` followed by
``nll_loss`` is covered by the log-softmax rule.

An elementwise loss of an input and a target (``mse_loss``, ``l1_loss``, ``smooth_l1_loss``,
``huber_loss``, ``binary_cross_entropy_with_logits``) keeps both, exact, for a gradient
``g * f'(x, target)``: :class:`PackedLossDerivative` keeps the derivative instead, computed in
forward and rounded at ``sensitive_bits`` (the gradient is linear in it: unbiased), a tensor of
the input's size where PyTorch kept two (a diffusion model's predicted and target noise).
"""

from __future__ import annotations

import functools
import inspect
import sys

import torch
import torch.nn.functional as F  # noqa: N812
from torch._subclasses.fake_tensor import FakeTensor

from actune import tunables
from actune.packing.saved import check_double_backward, plain_saving, take
from actune.rules.activations import compressible
from actune.rules.registry import register
from actune.substitutes.functions import arg, index_dtype, one_class_per_row
from actune.substitutes.lazy_logits import LazyLogits, cross_entropy_in_chunks


@register((F.cross_entropy,), "loss", None,
          "probabilities rounded at sensitive bits (gradient linear in them), targets exact; "
          "forward in slices of rows; (N, C, d1, ...) logits as rows of classes")
def cross_entropy(s, func, args, kwargs, level):
    x, target = args[0], arg(args, kwargs, 1, "target", None)
    weight = arg(args, kwargs, 2, "weight", None)
    ignore_index = int(arg(args, kwargs, 4, "ignore_index", -100))
    reduction = arg(args, kwargs, 6, "reduction", "mean")
    smoothing = float(arg(args, kwargs, 7, "label_smoothing", 0.0))
    legacy = (arg(args, kwargs, 3, "size_average", None), arg(args, kwargs, 5, "reduce", None))
    if isinstance(x, LazyLogits):
        out = cross_entropy_in_chunks(x, target, weight, ignore_index, reduction, smoothing,
                                      legacy)
        if out is not None:
            return out
    if (not compressible(x, level) or not isinstance(target, torch.Tensor)
            or target.is_floating_point() or not one_class_per_row(x, target)
            or legacy != (None, None) or reduction not in ("mean", "sum", "none")
            or (weight is not None and (smoothing or weight.requires_grad))):
        return None  # class probabilities as targets, legacy arguments...: PyTorch's own
    if x.dim() == 2:
        return PackedCrossEntropy.apply(x, target, weight, ignore_index, reduction, smoothing,
                                        level.sensitive_width, s)
    # (N, C, d1, ...) logits, a segmentation's: one row of classes per position. The rows
    # are a copy while the loss is computed (PyTorch's log-probabilities are as large, and
    # kept until backward); what is kept is their packed probabilities
    rows = x.movedim(1, -1).reshape(-1, x.shape[1])
    out = PackedCrossEntropy.apply(rows, target.reshape(-1), weight, ignore_index, reduction,
                                   smoothing, level.sensitive_width, s)
    return out.reshape(target.shape) if reduction == "none" else out


#: Below this, a target's probability has lost precision (float32's smallest normal is
#: 2**-126): its row's loss comes from the log-probabilities instead.
_TINY = 2.0 ** -100


def _probabilities(x: torch.Tensor, target: torch.Tensor, smoothing: float,
                   one_pass: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The softmax of float ``x`` (rows of logits) and each row's loss against ``target``
    (``[rows, 1]``): one softmax pass, where ``log_softmax`` then ``exp`` took three. The loss
    is ``-log p_target``, and ``-(mean log p)`` under label smoothing (``mean x - lse``, with
    ``lse = x_target - log p_target``); rows whose target probability underflows take the
    log-softmax's exact value. Without ``one_pass`` (off the CPU, where checking for such
    rows would wait for the device) the log-softmax and its ``exp``: no check needed."""
    if not one_pass:
        logp, loss = _from_log_probabilities(x, target, smoothing)
        return logp.exp_(), loss
    p = torch.softmax(x, 1)
    picked = p.gather(1, target).squeeze(1)
    log_picked = picked.log()
    loss = log_picked.neg()
    if smoothing:
        lse = x.gather(1, target).squeeze(1).sub_(log_picked)
        loss = loss.mul_(1 - smoothing).sub_(x.mean(1).sub_(lse).mul_(smoothing))
    tiny = picked < _TINY
    if _has_values(picked) and tiny.any():  # (rare: a loss above about 69)
        loss[tiny] = _from_log_probabilities(x[tiny], target[tiny], smoothing)[1]
    return p, loss


def _from_log_probabilities(x: torch.Tensor, target: torch.Tensor,
                            smoothing: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The log-softmax of ``x`` and each row's loss from it."""
    logp = torch.log_softmax(x, 1)
    loss = logp.gather(1, target).squeeze(1).neg_()
    if smoothing:
        loss = loss.mul_(1 - smoothing).sub_(logp.mean(1).mul_(smoothing))
    return logp, loss


def _has_values(t: torch.Tensor) -> bool:
    """Not a fake tensor (an estimate's step: shapes only, no branch on values)."""
    return not isinstance(t, FakeTensor)


def _row_weights(valid: torch.Tensor, target: torch.Tensor,
                 weight: torch.Tensor | None) -> torch.Tensor:
    """Each row's weight in the loss: its class's (1 without class weights), 0 where it does
    not count (``target`` holds any class there)."""
    rows = valid.to(torch.float32)
    return rows if weight is None else rows.mul_(weight.float()[target])


def _pack_targets(session, target: torch.Tensor, valid: torch.Tensor, classes: int,
                  kind: str) -> object:
    """What backward reads of class targets: each row's class in the narrowest integers that
    hold it, ``classes`` for a row that does not count, where PyTorch keeps int64 targets (as
    large as 4-bit probabilities of 16 classes: a segmentation's)."""
    return session.packer.pack_small_ints(torch.where(valid, target, classes), kind, (target,),
                                          index_dtype(classes + 1))


def _unpack_targets(saved, classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(targets, with class 0 where a row does not count; which rows count) of
    :func:`_pack_targets`' value."""
    target = saved.get().long()
    valid = target != classes
    return target.masked_fill_(~valid, 0), valid


class PackedCrossEntropy(torch.autograd.Function):
    """Cross entropy over ``(N, C)`` logits keeping the probabilities packed (higher-dimensional
    logits come as rows: see :func:`cross_entropy`)."""

    @staticmethod
    def forward(ctx, x, target, weight, ignore_index, reduction, smoothing, bits, session):
        n, classes = x.shape
        valid = target != ignore_index
        safe = torch.where(valid, target, 0)
        row_weight = _row_weights(valid, safe, weight)
        rows = max(1, tunables.LOSS_SLICE // max(classes, 1))
        # (one slice, most steps' case: its losses are the result, with no buffer to fill)
        losses = None if n <= rows else torch.empty(n, dtype=torch.float32, device=x.device)
        packed = []
        for start in range(0, n, rows):
            if losses is None:
                p, losses = _probabilities(x.float(), safe[:, None], smoothing, x.is_cpu)
            else:
                p, losses[start:start + rows] = _probabilities(
                    x[start:start + rows].float(), safe[start:start + rows, None], smoothing,
                    x.is_cpu)
            if x.dtype != torch.float32:
                p = p.to(x.dtype)
            session.accounting.count(p)  # PyTorch keeps the log-probabilities, as large
            packed.append(session.packer.pack_fixed(p, bits, "cross_entropy"))
            del p
        losses.mul_(row_weight)
        ctx.packed, ctx.rows = packed, rows
        ctx.target = _pack_targets(session, target, valid, classes, "cross_entropy targets")
        ctx.weight = weight
        ctx.conf = (reduction, smoothing, classes, x.dtype)
        if reduction == "none":
            return losses.to(x.dtype)
        total = losses.sum()
        if reduction == "mean":
            ctx.total = row_weight.sum()
            total = total / ctx.total
        return total.to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        check_double_backward()
        reduction, smoothing, classes, dtype = ctx.conf
        packed = take(ctx, "packed")
        target, valid = _unpack_targets(take(ctx, "target"), classes)
        coef = _row_weights(valid, target, ctx.weight).mul_(grad.float())  # d loss / d p
        if reduction == "mean":
            coef = coef / ctx.total
        out = torch.empty((target.numel(), classes), dtype=dtype, device=grad.device)
        rows = ctx.rows
        for i, saved in enumerate(packed):
            start = i * rows
            c = coef[start:start + rows, None]
            in_place = dtype == torch.float32  # (dequantized where it goes: no copy)
            part = (saved.get_into(out[start:start + rows]).mul_(c) if in_place
                    else saved.fresh().float().mul_(c))
            part.scatter_add_(1, target[start:start + rows, None], -(1 - smoothing) * c)
            if smoothing:
                part.sub_(c * (smoothing / classes))
            if not in_place:
                out[start:start + rows] = part
            del part
        return out, None, None, None, None, None, None, None


@functools.cache
def _parameters(func) -> tuple[str, ...]:
    return tuple(inspect.signature(func).parameters)


def _arguments(func, args: tuple, kwargs: dict) -> dict:
    """The arguments given to ``func``, by name (the defaults not filled in)."""
    return dict(zip(_parameters(func), args, strict=False)) | kwargs


def _huber_slope(x: torch.Tensor, target: torch.Tensor, delta: float) -> torch.Tensor:
    return (x - target).clamp_(-delta, delta)


def _smooth_l1_slope(x: torch.Tensor, target: torch.Tensor, beta: float) -> torch.Tensor:
    if beta == 0:
        return (x - target).sign_()
    return (x - target).div_(beta).clamp_(-1, 1)


def _logistic_slope(x: torch.Tensor, target: torch.Tensor, pos_weight) -> torch.Tensor:
    """``d/dx`` of ``-(p y log s(x) + (1 - y) log(1 - s(x)))``: ``s(x) (p y + 1 - y) - p y``."""
    if pos_weight is None:
        return torch.sigmoid(x).sub_(target)
    scaled = target * pos_weight
    return torch.sigmoid(x).mul_(scaled + 1 - target).sub_(scaled)


def _kl_slope(_x: torch.Tensor, target: torch.Tensor, log_target: bool) -> torch.Tensor:
    """``d/dx`` of ``target * (log target - x)``: ``-target``."""
    return target.exp().neg_() if log_target else target.neg()


#: loss -> (the argument its derivative takes besides the input and the target, with its
#: default; the derivative; does the target's gradient mirror the input's)
_ELEMENTWISE = {
    F.mse_loss: (None, lambda x, t, _: (x - t).mul_(2), True),
    F.l1_loss: (None, lambda x, t, _: (x - t).sign_(), True),
    F.smooth_l1_loss: (("beta", 1.0), _smooth_l1_slope, True),
    F.huber_loss: (("delta", 1.0), _huber_slope, True),
    F.binary_cross_entropy_with_logits: (("pos_weight", None), _logistic_slope, False),
    # (a distillation's: the teacher's probabilities, as large as the logits)
    F.kl_div: (("log_target", False), _kl_slope, False),
}
#: What PyTorch keeps of each loss's input and target (the rest: both).
_PYTORCH_KEEPS = {F.l1_loss: lambda x, t, d: (d,),  # (an abs of the difference)
                  F.kl_div: lambda x, t, d: (t,)}


@register(tuple(_ELEMENTWISE), "loss", None,
          "the derivative in the input, computed in forward and rounded at sensitive bits "
          "(gradient linear in it), in place of the input and the target")
def elementwise_loss(s, func, args, kwargs, level):
    x, target = args[0], arg(args, kwargs, 1, "target", None)
    option, slope, mirrored = _ELEMENTWISE[func]
    bound = _arguments(func, args, kwargs)
    if func is F.l1_loss and "weight" not in bound:
        weight = _l1_weight()
        if weight is not None:  # (see _l1_weight: PyTorch's own, with it)
            return func(*args, **kwargs, weight=weight)
    weight, reduction = bound.get("weight"), bound.get("reduction", "mean")
    value = bound.get(option[0], option[1]) if option else None
    if (not compressible(x, level) or not isinstance(target, torch.Tensor)
            or target.shape != x.shape or not target.is_floating_point()
            or bound.get("size_average") is not None or bound.get("reduce") is not None
            or reduction not in ("mean", "sum", "none", "batchmean")
            or (target.requires_grad and not mirrored)
            # (a regression loss's weight: what its mean divides by is not taken here)
            or (weight is not None and func is not F.binary_cross_entropy_with_logits)
            or any(isinstance(t, torch.Tensor) and t.requires_grad for t in (weight, value))):
        return None  # (broadcast shapes, legacy arguments, learned weights: PyTorch's own)
    return PackedLossDerivative.apply(x, target, func, bound, slope, value, weight, mirrored,
                                      level.sensitive_width, s)


def _l1_weight() -> torch.Tensor | None:
    """The ``weight`` a caller gave ``F.l1_loss``, which its hand-off to a function mode drops
    (torch 2.13: every mode, actune's or not, would see an unweighted loss), read from its
    frame; None if none was given."""
    frame = sys._getframe(2)
    code = F.l1_loss.__code__
    for _ in range(8):
        if frame is None:
            return None
        if frame.f_code is code:
            return frame.f_locals.get("weight")
        frame = frame.f_back
    return None


class PackedLossDerivative(torch.autograd.Function):
    """An elementwise loss keeping ``f'(x, target)`` (times its weight) rounded, not its
    input and target (see :func:`elementwise_loss`)."""

    @staticmethod
    def forward(ctx, x, target, func, bound, slope, value, weight, mirrored, bits, session):
        out = func(**{**bound, "input": x, "target": target})
        d = slope(x.float(), target.float(), value)
        if weight is not None:
            d = d.mul_(weight)
        kept = _PYTORCH_KEEPS.get(func, lambda x, t, d: (x, t))(x, target, d)
        ctx.d = session.packer.pack_fixed(d, bits, "loss derivative", replaces=kept)
        reduction = bound.get("reduction", "mean")
        count = (x.numel() if reduction == "mean" else x.shape[0] if reduction == "batchmean"
                 else 1)
        ctx.conf = (count, x.dtype, mirrored)  # (count: what the reduction divides by)
        return out

    @staticmethod
    def backward(ctx, grad):
        check_double_backward()
        count, dtype, mirrored = ctx.conf
        d = take(ctx, "d").get()
        scale = grad if count == 1 else grad / count
        dx = d.mul_(scale).to(dtype) if d.dtype == torch.float32 else (d.float() * scale).to(
            dtype)
        dt = -dx if mirrored and ctx.needs_input_grad[1] else None
        return dx, dt, None, None, None, None, None, None, None, None


@register((F.ctc_loss,), "loss", None,
          "the gradient in the log-probabilities, computed in forward and rounded at "
          "sensitive bits (the loss's gradient is linear in it), in place of the "
          "log-probabilities and the forward variables")
def ctc_loss(s, func, args, kwargs, level):
    """Speech recognition's CTC loss keeps its log-probabilities and its forward variables
    (``[batch, frames, 2 * target length + 1]``) for a backward that runs the alignment
    again. Each sample's loss depends on its own frames alone, so the gradient of the
    per-sample losses, computed in forward, is all backward needs: it scales each sample's
    by the output's gradient (:class:`PackedCTC`)."""
    bound = _arguments(func, args, kwargs)
    x, reduction = bound["log_probs"], bound.get("reduction", "mean")
    if (not compressible(x, level) or x.dim() not in (2, 3) or reduction not in
            ("mean", "sum", "none") or not x.requires_grad):
        return None
    return PackedCTC.apply(x, bound, level.sensitive_width, s)


def _longest(targets, lengths: torch.Tensor) -> int | None:
    """The longest target's length: a padded ``[batch, S]`` target's ``S``, else the largest
    of ``lengths`` where they are on the host (concatenated targets); None where reading them
    would wait for the device."""
    if isinstance(targets, torch.Tensor) and targets.dim() == 2:
        return int(targets.shape[1])
    if not lengths.is_cpu or isinstance(lengths, FakeTensor):
        return None
    return int(lengths.max()) if lengths.numel() else 0


class PackedCTC(torch.autograd.Function):
    """CTC keeping ``d loss_n / d log_probs``, rounded (see :func:`ctc_loss`)."""

    @staticmethod
    def forward(ctx, x, bound, bits, session):
        reduction = bound.get("reduction", "mean")
        with torch.enable_grad(), plain_saving():
            leaf = x.detach().requires_grad_()
            losses = F.ctc_loss(**{**bound, "log_probs": leaf, "reduction": "none"})
            (d,) = torch.autograd.grad(losses.sum(), leaf)
        losses = losses.detach()
        ctx.d = session.packer.pack_fixed(d, bits, "ctc_loss gradient", replaces=(x,))
        del d
        lengths = torch.as_tensor(bound["target_lengths"], device=x.device)
        # PyTorch's own keeps its forward variables too: a float a frame and target state
        # (counted where the longest target is known without waiting for the device)
        longest = _longest(bound["targets"], lengths)
        if longest is not None:
            frames, batch = x.shape[0], (x.shape[1] if x.dim() == 3 else 1)
            session.accounting.count_internal(frames * batch * (2 * longest + 1)
                                              * x.element_size())
        ctx.conf = (reduction, x.dim(), x.dtype)
        if reduction == "none":
            return losses
        if reduction == "sum":
            return losses.sum()
        per_target = lengths.clamp(min=1).to(losses.dtype)
        ctx.per_target = per_target  # (one number a sample)
        return (losses / per_target).mean()

    @staticmethod
    def backward(ctx, grad):
        check_double_backward()
        reduction, dims, dtype = ctx.conf
        d = take(ctx, "d").get()
        if reduction == "mean":
            per_sample = grad / (ctx.per_target * ctx.per_target.numel())
        else:
            per_sample = grad  # (a number for sum, one a sample for none)
        if dims == 3:  # [frames, batch, classes]
            per_sample = per_sample.reshape(1, -1, 1) if per_sample.dim() else per_sample
        return d.mul_(per_sample).to(dtype), None, None, None


@register((F.nll_loss,), "loss", None,
          "the targets exact, in the narrowest integers holding the classes (PyTorch keeps "
          "int64 ones); the input not kept (its gradient reads only the targets)")
def nll_loss(s, func, args, kwargs, level):
    """``nll_loss`` (after a log-softmax, whose rule packs the probabilities) keeps the int64
    targets, as large as 2-bit probabilities of 32 classes: a segmentation's per-pixel ones.
    The rule keeps them in the narrowest integers, an ignored target as ``classes``."""
    bound = _arguments(func, args, kwargs)
    x, target, weight = bound["input"], bound["target"], bound.get("weight")
    if (not isinstance(target, torch.Tensor) or target.is_floating_point()
            or not one_class_per_row(x, target) or target.numel() < level.min_numel
            or bound.get("size_average") is not None or bound.get("reduce") is not None
            or bound.get("reduction", "mean") not in ("mean", "sum", "none")
            or (isinstance(weight, torch.Tensor) and weight.requires_grad)):
        return None
    return CompactNLL.apply(x, target, bound, s)


class CompactNLL(torch.autograd.Function):
    """``nll_loss`` keeping its targets compact (see :func:`nll_loss`); backward scatters
    ``-weight * grad`` at each target, as PyTorch's."""

    @staticmethod
    def forward(ctx, x, target, bound, session):
        out = F.nll_loss(**{**bound, "input": x, "target": target})
        classes = x.shape[1]
        valid = target != bound.get("ignore_index", -100)
        ctx.target = _pack_targets(session, target, valid, classes, "nll_loss targets")
        weight, reduction = bound.get("weight"), bound.get("reduction", "mean")
        ctx.weight = weight
        if reduction == "mean":  # (the weights of the counted targets, summed)
            ctx.total = _row_weights(valid, torch.where(valid, target, 0), weight).sum()
        ctx.conf = (reduction, classes, x.shape, x.dtype)
        return out

    @staticmethod
    def backward(ctx, grad):
        check_double_backward()
        reduction, classes, shape, dtype = ctx.conf
        target, valid = _unpack_targets(take(ctx, "target"), classes)
        w = _row_weights(valid, target, ctx.weight)
        g = grad.float()
        w = w.mul_(g / ctx.total if reduction == "mean" else g)
        out = torch.zeros(shape, dtype=torch.float32, device=grad.device)
        out.scatter_add_(1, target.unsqueeze(1), w.neg_().unsqueeze(1))
        return out.to(dtype), None, None, None
