"""The LM head and its cross entropy in chunks of tokens: the logits are never whole.

``cross_entropy(hidden @ weight.T + bias, target)`` over a vocabulary of ``V`` words holds
``tokens x V`` floats of logits, their log-probabilities and, in backward, their gradient: for a
small language model the largest tensors of a step (Cut Cross-Entropy, Wijmans et al., 2024;
Liger-Kernel's fused linear cross entropy). :func:`linear_cross_entropy` computes the same loss
one chunk of tokens at a time, forward and backward:

* a summed or averaged loss (what a training step takes, and what Hugging Face's models
  compute): the loss is the root of backward, so the gradient of every token's logits,
  ``(softmax - one_hot)`` times the same factor, is known in forward. Each chunk's is
  multiplied at once into the hidden states' and the weight's gradients, which forward
  keeps (exact: the size of the hidden states and of the weight); backward only scales them
  by the incoming gradient. No logit is computed twice (Liger-Kernel's fused linear cross
  entropy does the same);
* per-token losses (``reduction="none"``), whose gradient is known only in backward: forward
  keeps the hidden states, and backward computes each chunk's logits again. Under
  :func:`actune.compressed` at a compressing level the hidden states are then kept at the
  level's ``nonlinear_bits`` (8 at L2-L5: backward reads them through the softmax of the
  recomputed logits, where rounding leaves a small bias, as for attention's q and k); exact
  where that width is unset and outside any compressed block.

Kept exact, the loss and gradients are the unfused ops' to float tolerance.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F  # noqa: N812
from torch._subclasses.fake_tensor import FakeTensor

from actune import tunables
from actune.packing.saved import check_double_backward, take
from actune.session.hooks import _session, active_level
from actune.substitutes import lazy_logits

__all__ = ["linear_cross_entropy"]


_REDUCTIONS = ("mean", "sum", "none")


def _starts(h: torch.Tensor, rows: int) -> range:
    """The first token of each chunk; in an estimate (fake tensors) the first chunk's alone:
    every chunk allocates and frees the same, so one gives the step's peak. (Traced by
    torch.compile, whose tensors are fake too: every chunk.)"""
    estimate = isinstance(h, FakeTensor) and not torch.compiler.is_compiling()
    return range(0, rows if estimate else h.shape[0], rows)


def chunk_rows(tokens: int, hidden: int, vocabulary: int) -> int:
    """Tokens per chunk (see :data:`tunables.CHUNK_ELEMENTS`)."""
    by_budget = tunables.CHUNK_ELEMENTS // max(vocabulary, 1)
    by_share = math.ceil(tokens * hidden / max(vocabulary, 1))
    return max(1, min(tokens, max(by_budget, by_share)))


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                         bias: torch.Tensor | None = None, *, ignore_index: int = -100,
                         reduction: str = "mean", softcap: float | None = None,
                         divide_by: torch.Tensor | float | None = None) -> torch.Tensor:
    """``F.cross_entropy(F.linear(hidden, weight, bias), target)`` without the whole logits.

    ``hidden``: ``(..., H)``; ``weight``: ``(V, H)``; ``target``: class indices of
    ``hidden``'s leading shape (``ignore_index`` where no loss is taken). ``softcap``: the
    logits pass through ``softcap * tanh(logits / softcap)`` first (Gemma's final logit
    soft-capping). ``reduction`` as PyTorch's; ``divide_by``: with ``"sum"``, the total is
    divided by it (Hugging Face's ``num_items_in_batch`` under gradient accumulation).
    Returns float32, as a loss computed from upcast logits is.
    """
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, not {reduction!r}")
    if weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden states of width {hidden.shape[-1]} do not match a weight of "
                         f"shape {tuple(weight.shape)} (vocabulary x hidden size)")
    if target.shape != hidden.shape[:-1]:
        raise ValueError(f"target shape {tuple(target.shape)} does not match the hidden "
                         f"states' leading shape {tuple(hidden.shape[:-1])}")
    h = hidden.reshape(-1, hidden.shape[-1])
    t = target.reshape(-1).to(h.device)
    if reduction == "none":
        losses = LinearCrossEntropy.apply(h, weight, bias, t, ignore_index, softcap,
                                          _kept_bits())
        return losses.reshape(target.shape)
    total = SummedLinearCrossEntropy.apply(h, weight, bias, t, ignore_index, softcap)
    if reduction == "sum":
        return total if divide_by is None else total / divide_by
    return total / (t != ignore_index).sum()


def _compressing():
    """The session of the :func:`actune.compressed` block compressing what is saved now, or
    None (outside one; in code torch.compile traces, whose graphs pack on their own)."""
    if torch.compiler.is_compiling() or active_level() is None:
        return None
    s = _session()
    return s if s.compressing() else None


def _kept_bits() -> int | None:
    """The bits the hidden states are kept at: the innermost compressed block's
    ``nonlinear_bits`` where it compresses what is saved now (None: exact)."""
    s = _compressing()
    return None if s is None else s.level.nonlinear_bits


def _logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            softcap: float | None) -> tuple[torch.Tensor, torch.Tensor | None, torch.dtype]:
    """A chunk's float32 logits (after soft-capping), the ``tanh`` of the capping (None
    without) and the dtype the product ran in (autocast's, or the operands')."""
    z = F.linear(h, weight, bias)
    dtype = z.dtype
    z = z.float()
    if softcap is None:
        return z, None, dtype
    capped = torch.tanh(z.div_(softcap))
    return capped * softcap, capped, dtype


def _logit_gradient(z: torch.Tensor, capped: torch.Tensor | None, target: torch.Tensor,
                    coef: torch.Tensor) -> torch.Tensor:
    """d loss / d (the head's output) of a chunk from its capped logits ``z``:
    ``coef * (softmax(z) - one_hot(target))``, through the soft cap's ``1 - tanh^2`` (its
    ``capped`` tanh squared in place)."""
    d = torch.softmax(z, 1)
    d.scatter_add_(1, target[:, None], torch.full_like(coef, -1.0)).mul_(coef)
    if capped is not None:
        d.mul_(capped.square_().neg_().add_(1))
    return d


class _Gradients:
    """The gradients of ``h`` (its dtype), the weight and the bias (float32 sums), each where
    asked for, filled a chunk's logit gradient at a time."""

    def __init__(self, h, weight, needs: tuple[bool, bool, bool]) -> None:
        need_h, need_w, need_b = needs
        self.h = torch.empty_like(h) if need_h else None
        self.weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if need_w else None
        self.bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) \
            if need_b else None
        self._of, self._cast = weight, None  # (the weight in the product's dtype, once)

    def add(self, d: torch.Tensor, rows: slice, hc: torch.Tensor, dtype: torch.dtype) -> None:
        """Take chunk ``rows``' logit gradient ``d`` (its hidden states ``hc``; the product
        ran in ``dtype``)."""
        if self.h is not None:
            if self._cast is None:
                self._cast = self._of.to(dtype)
            self.h[rows] = d.to(dtype) @ self._cast
        if self.weight is not None:
            self.weight.addmm_(d.t(), hc.float())
        if self.bias is not None:
            self.bias.add_(d.sum(0))


class SummedLinearCrossEntropy(torch.autograd.Function):
    """The summed cross entropy of ``F.linear(h, weight, bias)`` (``h``: ``(N, H)``), its
    gradients computed chunk by chunk in forward (see the module docstring)."""

    @staticmethod
    def forward(ctx, h, weight, bias, target, ignore_index, softcap):
        n = h.shape[0]
        rows = chunk_rows(n, h.shape[1], weight.shape[0])
        valid = target != ignore_index
        safe = torch.where(valid, target, 0)
        coef = valid.to(torch.float32)[:, None]
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grads = _Gradients(h, weight, (need_h, need_w, need_b and bias is not None))
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        for start in _starts(h, rows):
            stop = min(start + rows, n)
            hc = h[start:stop]
            z, capped, dtype = _logits(hc, weight, bias, softcap)
            picked = z.gather(1, safe[start:stop, None])
            total += (torch.logsumexp(z, 1, keepdim=True) - picked).mul_(coef[start:stop]).sum()
            d = _logit_gradient(z, capped, safe[start:stop], coef[start:stop])
            del z, capped
            grads.add(d, slice(start, stop), hc, dtype)
            del d
        s = _compressing()
        keep = (lambda t, _: t) if s is None else s.packer.keep_exact
        ctx.grads = tuple(None if g is None else keep(g, label) for g, label in (
            (grads.h, "lm_head gradient"), (grads.weight, "lm_head weight gradient"),
            (grads.bias, "lm_head bias gradient")))
        ctx.dtypes = (h.dtype, weight.dtype, None if bias is None else bias.dtype)
        return total

    @staticmethod
    def backward(ctx, grad):
        check_double_backward()
        # (traced: the graph owns its tensors' lifetimes; eager: let go as backward reads)
        grads = ctx.grads if torch.compiler.is_compiling() else take(ctx, "grads")
        out = [None if g is None else g.mul(grad.to(g.dtype)).to(dtype)
               for g, dtype in zip(grads, ctx.dtypes, strict=True)]
        return (*out, None, None, None)


class LinearCrossEntropy(torch.autograd.Function):
    """Per-token cross entropy of ``F.linear(h, weight, bias)`` (``h``: ``(N, H)``), chunk by
    chunk; backward recomputes each chunk's logits (see the module docstring)."""

    @staticmethod
    def forward(ctx, h, weight, bias, target, ignore_index, softcap, bits):
        n = h.shape[0]
        rows = chunk_rows(n, h.shape[1], weight.shape[0])
        valid = target != ignore_index
        safe = torch.where(valid, target, 0)
        losses = torch.empty(n, dtype=torch.float32, device=h.device)
        dtype = h.dtype
        for start in _starts(h, rows):
            stop = min(start + rows, n)
            z, _, dtype = _logits(h[start:stop], weight, bias, softcap)
            picked = z.gather(1, safe[start:stop, None]).squeeze(1)
            losses[start:stop] = torch.logsumexp(z, 1).sub_(picked)
            del z
        losses.mul_(valid)
        ctx.rows, ctx.softcap, ctx.dtype = rows, softcap, dtype
        ctx.has_bias = bias is not None
        s = _session()  # (bits: a compressing block is open)
        if bits is not None and any(ctx.needs_input_grad[:3]):
            s.accounting.count(h)
            ctx.packed = s.packer.pack_fixed(h.detach(), bits, "lm_head", by_feature=True)
            ctx.save_for_backward(weight, bias, safe, valid)
        else:
            ctx.packed = None
            ctx.save_for_backward(weight, bias, safe, valid, h)
        return losses

    @staticmethod
    def backward(ctx, grad):
        check_double_backward()
        if ctx.packed is not None:
            weight, bias, safe, valid = ctx.saved_tensors
            h = take(ctx, "packed").get()
        else:
            weight, bias, safe, valid, h = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        coef = grad.float() * valid  # per token: d loss / d logits = coef * (p - one_hot)
        grads = _Gradients(h, weight, (need_h, need_w, need_b and ctx.has_bias))
        rows, softcap, n = ctx.rows, ctx.softcap, h.shape[0]
        for start in _starts(h, rows):
            stop = min(start + rows, n)
            hc = h[start:stop]
            z, capped, _ = _logits(hc, weight, bias, softcap)
            d = _logit_gradient(z, capped, safe[start:stop], coef[start:stop, None])
            del z, capped
            grads.add(d, slice(start, stop), hc, ctx.dtype)
            del d
        return (grads.h, None if grads.weight is None else grads.weight.to(weight.dtype),
                None if grads.bias is None else grads.bias.to(bias.dtype),
                None, None, None, None)


lazy_logits.provide(linear_cross_entropy=linear_cross_entropy)  # (see there)
