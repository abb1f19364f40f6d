"""Mixed precision for saved activations: bits where the gradient is sensitive.

Stochastic rounding of a saved activation to ``b`` bits adds variance to the gradient, and
that variance falls as ``1 / (2**b - 1)**2``. For compressed tensor ``l`` (and, along the batch
dimension, sample ``n``) it is about ``C_ln / (2**b_ln - 1)**2``; :func:`allocate` chooses
``b_ln`` in {1, 2, 4, 8} to minimise ``sum C_ln / (2**b_ln - 1)**2`` under the memory budget
``sum b_ln * numel_ln <= avg_bits * sum numel_ln`` (ActNN, ICML 2021, section 4).

:class:`AutoPrecision` estimates ``C_ln`` from what a training step already has (the derivation
is in docs/autoprec.md): the per-group steps stored in each packed tensor's metadata give the
rounding noise per element at one bit, and the gradient reaching the op that reads the tensor
gives its sensitivity. Statistics are gathered on one step in ``every``; they stay on the
device until the next step starts, when one transfer brings them all to the host and the bits
are allocated again. No step synchronises per layer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from actune.autoprec.solver import (
    CHOICES,
    NOISE,
    NOISE4,
    allocate,
    non_increasing,
    objective,
    widest,
)
from actune.packing.formats import PackedRows, PackedSamples, PackedTensor
from actune.packing.samples import row_norms
from actune.packing.tensors import group_steps

__all__ = ["CHOICES", "AutoPrecision", "Plan", "allocate", "objective"]

# ---------------------------------------------------------------------------------------------
# The allocator attached to a training run.


@dataclass(frozen=True)
class Plan:
    """How to pack one compressed tensor: ``bits`` for all of it, or ``by_rank`` (bits, count)
    runs for its ``samples`` ranked by magnitude, largest first (``bits`` is then the widest).
    ``collect``: this is a statistics step; report the packed tensor to :meth:`observe`."""

    slot: int
    bits: int
    samples: int = 1
    by_rank: tuple[tuple[int, int], ...] = ()
    collect: bool = False
    weight: torch.Tensor | None = field(default=None, compare=False)  # per-sample rank weight


@dataclass
class _Slot:
    label: str
    numel: int
    samples: int  # along dim 0 (1: one item for the whole tensor)
    min_bits: int
    zero_code: bool = False  # exact zeros: a 1-bit mask if nothing reads the rest
    cost: np.ndarray | None = None  # C per sample, sorted largest first (or [C])
    quartic: np.ndarray | None = None  # the 1/B**4 coefficient, in the same order
    bits: np.ndarray | None = None  # bits per rank
    #: saved tensors the slot stands for in the budget (2: a layer norm's output, rebuilt
    #: from its packed input, is a second saved tensor that keeps no bits of its own)
    shares: int = 1
    # gathered on a statistics step, on the device
    noise: torch.Tensor | None = None  # per-sample rounding noise at one bit
    direct: torch.Tensor | None = None  # per sample: sum of fan_in * |grad|^2 over matmuls
    # relayed noise, per relaying op: [position, linear, second-order, coherent] per sample
    relayed: list = field(default_factory=list)
    score: torch.Tensor | None = None  # per-sample norm: the rank a sample gets in forward

    @property
    def per_sample_numel(self) -> int:
        return self.numel // self.samples


@dataclass
class AutoPrecision:
    """Allocates bits to compressed tensors every ``every`` steps, ``avg_bits`` on average.

    Attach it to a run with ``actune.compress(model, "L3")`` (which makes one, see
    :func:`actune.autoprec_of`) or ``actune.compressed(level, autoprec=ap)``. Slots are the
    compressed tensors of a step in the order they are saved; ``per_sample`` lets samples of
    one tensor get different bits (tensors whose dim 0 is the batch). Samples are ranked in
    forward by their norm, times the gradient size remembered for them when the training loop
    names them (:meth:`samples`, as ActNN does): once a model has learned something, a few
    samples carry most of the gradient, and they get the wide widths. On by default.
    """

    avg_bits: float = 2.0
    every: int = 50
    per_sample: bool = True
    steps: int = 0
    reallocations: int = 0
    slots: list[_Slot] = field(default_factory=list)
    _fresh: list[_Slot] = field(default_factory=list, repr=False)
    #: True during a statistics step (an attribute, not a property: the routing reads it
    #: on every call)
    collecting: bool = field(default=False, init=False, repr=False)
    #: True while this step's named samples still need their gradient recorded
    tracking: bool = field(default=False, init=False, repr=False)
    _cursor: int = field(default=0, repr=False)
    _batch: int | None = field(default=None, repr=False)
    _position: int = field(default=0, repr=False)
    _sizes: list = field(default_factory=list, repr=False)
    #: per dataset sample: the mean square of its gradient (at the first op's output) when it
    #: was last seen, halved towards each new value (0: never seen)
    sensitivity: torch.Tensor | None = field(default=None, repr=False, compare=False)
    _ids: torch.Tensor | None = field(default=None, repr=False, compare=False)
    _next_ids: torch.Tensor | None = field(default=None, repr=False, compare=False)
    _weight: torch.Tensor | None = field(default=None, repr=False, compare=False)
    _force: bool = field(default=False, repr=False)

    def __post_init__(self) -> None:
        if not CHOICES[0] <= self.avg_bits <= CHOICES[-1]:
            raise ValueError(f"avg_bits must be within [1, 8], got {self.avg_bits}")
        if self.every < 0:
            raise ValueError("every must be >= 0 (0: never collect again)")

    # -- the step's life cycle (called by actune.session.hooks)
    # ----------------------------------------

    def begin_step(self) -> None:
        """A forward pass starts: fold the previous statistics step, if any, and reallocate."""
        if self._fresh:
            self._fold()
        self.collecting = self.every > 0 and self.steps % self.every == 0
        if self.steps == 0 or self._force:
            self.collecting, self._force = True, False
        self.steps += 1
        self._cursor = 0
        self._position = 0
        self._sizes = []
        self._batch = None
        self._fresh = []
        self._ids, self._next_ids = self._next_ids, None
        self._weight = None
        self.tracking = self.per_sample and self._ids is not None

    def samples(self, ids: torch.Tensor | Sequence[int]) -> None:
        """Name the samples of the next step's batch: their indices in the dataset, in batch
        order (on the CPU, as a data loader has them; nothing waits). With ``per_sample``,
        the gradient each sample receives is remembered (:attr:`sensitivity`) and weighs its
        rank the next time it comes."""
        self._next_ids = torch.as_tensor(ids, device="cpu").reshape(-1).long()

    def track(self, output: torch.Tensor | None) -> None:
        """Record each named sample's gradient at ``output`` (the first op output of the step
        with one row per sample), on the device."""
        ids = self._ids
        if (output is None or ids is None or type(output) is not torch.Tensor
                or not output.requires_grad or output.dim() < 1
                or output.shape[0] != ids.numel()):
            return
        self.tracking = False
        table = self._table(output.device, int(ids.max()) + 1)
        at = ids.to(output.device, non_blocking=True)

        def hook(grad: torch.Tensor) -> None:
            with torch.no_grad():
                g2 = grad.detach().float().reshape(grad.shape[0], -1).square().mean(1)
                old = table[at]
                table[at] = torch.where(old > 0, 0.5 * (old + g2), g2)

        output.register_hook(hook)

    def _table(self, device: torch.device, size: int) -> torch.Tensor:
        table = self.sensitivity
        if table is None or table.device != device:
            table = torch.zeros(0, device=device) if table is None else table.to(device)
        if table.numel() < size:
            table = torch.cat([table, table.new_zeros(size - table.numel())])
        self.sensitivity = table
        return table

    def _sample_weight(self, device: torch.device) -> torch.Tensor | None:
        """This step's per-sample rank weight: the root of each named sample's remembered
        gradient size (the mean of the known ones for samples never seen), or None."""
        if self._weight is None and self._ids is not None and self.sensitivity is not None:
            table = self._table(device, int(self._ids.max()) + 1)
            s = table[self._ids.to(device, non_blocking=True)]
            known = (s > 0).sum()
            fill = torch.where(known > 0, s.sum() / known.clamp_min(1), 1.0)
            self._weight = torch.where(s > 0, s, fill).sqrt()
        return self._weight

    def plan(self, t: torch.Tensor, zero_code: bool = False, floor: int = 1,
             split: bool = True, uniform: int | None = None) -> Plan:
        """How to pack the next compressed tensor of this step (at least ``floor`` bits;
        ``split=False``: one width for all its samples, whose groups mix them). A tensor no
        allocation covers yet (a statistics step's first, another shape) takes ``uniform``,
        the level's own width for it (as ``compressed(level)`` packs it, and as the tuner's
        estimate counts it), else the average's."""
        slot = self._cursor
        self._cursor += 1
        if self._batch is None:
            self._batch = int(t.shape[0]) if t.dim() else 1
        samples = self._samples(t) if split else 1
        min_bits = max(2 if zero_code else 1, floor)
        collect = self.collecting and type(t) is torch.Tensor  # not under FakeTensorMode
        if collect:
            self._fresh.append(_Slot(f"{tuple(t.shape)}", t.numel(), samples, min_bits,
                                     zero_code))
        known = self.slots[slot] if slot < len(self.slots) else None
        weight = (self._sample_weight(t.device) if samples > 1 and self._ids is not None
                  else None)
        if weight is not None and weight.numel() != samples:
            weight = None
        if known is None or known.bits is None or known.numel // known.samples != (
                t.numel() // samples) or known.min_bits != min_bits:
            bits = max(uniform, min_bits) if uniform else widest(self.avg_bits, min_bits)
            return Plan(slot, bits, samples, collect=collect,
                        weight=weight)
        ranks = known.bits
        if not ranks.any():  # zeros are all its readers need: a 1-bit mask
            return Plan(slot, 0, samples, collect=collect)
        if samples != known.samples:  # another batch size: keep the bits' proportions
            if samples > 1:
                ranks = ranks[(np.arange(samples) * known.samples) // samples]
            else:  # one item now: the widest width within the samples' mean
                ranks = np.array([widest(float(known.bits.mean()), min_bits)])
        runs = _runs(ranks)
        if len(runs) == 1:
            return Plan(slot, runs[0][0], samples, collect=collect, weight=weight)
        return Plan(slot, runs[0][0], samples, tuple(runs), collect=collect, weight=weight)

    def collect_next(self) -> None:
        """Make the next step a statistics step (and reallocate after it)."""
        self._force = True

    def observe(self, plan: Plan, packed: PackedTensor | PackedSamples | PackedRows,
                t: torch.Tensor | None = None, rows: int | None = None) -> None:
        """Record the rounding noise of the tensor ``t`` packed for ``plan`` (statistics
        steps), and the key by which its samples are ranked (norm, times the plan's weight).
        ``rows``: ``t`` was packed in groups of other than its rows, and its samples' noise is
        that of groups of ``rows`` elements along its rows (what per-sample widths pack)."""
        if plan.collect and plan.slot < len(self._fresh):
            slot = self._fresh[plan.slot]
            slot.noise = (rounding_noise(packed, plan.samples) if rows is None or t is None
                          else row_noise(t, plan.samples, rows))
            if plan.samples > 1 and t is not None:
                slot.score = row_norms(t.detach().reshape(plan.samples, -1))
                if plan.weight is not None:
                    slot.score = slot.score * plan.weight

    def share(self, slot: int) -> None:
        """Slot ``slot`` serves one more saved tensor (statistics steps): the budget counts
        its elements once more, and it keeps them in one packed copy."""
        if self.collecting and slot < len(self._fresh):
            self._fresh[slot].shares += 1

    def watch(self, slots: Sequence[int | tuple[int, torch.Tensor]], output: torch.Tensor,
              factor: float | torch.Tensor, *, relayed: bool,
              size: torch.Tensor | None = None,
              norm: tuple | None = None, reach_all: bool = True) -> list[list]:
        """The op reading ``slots`` produced ``output`` (statistics steps). Its gradient,
        times ``factor``, weighs their rounding noise: directly (a matmul's weight gradient)
        or ``relayed`` to the weight gradients of every matmul before it in the forward pass.
        A matmul gives ``size`` (``fan_in * mean(x**2)``): times ``|grad|**2`` it is how large
        its weight gradient is, which relayed noise perturbs. A batch norm gives ``norm``
        (its weight, the dims of its statistics, and the per-channel coherent factor or None):
        its input's noise reaches the input gradient through ``eps_hat * mean(grad * x_hat)``
        (the relayed share scaled by the squared correlation of grad and ``x_hat``, read off
        the weight's gradient, plus ``1 / M``), through the noise times itself (second order),
        and through ``x_hat * mean(grad * eps_hat)``, shared by a channel's elements
        (coherent); see docs/autoprec.md. ``reach_all=False``: relayed noise perturbs only the
        nearest matmul below (a residual branch's noise, diluted beyond it by the skip path's
        gradient). A slot given as ``(slot, scale)`` is read with its noise times ``scale``
        (a tensor rebuilt from it, :class:`actune.packing.saved.Derived`).

        Returns the relayed entries, filled once ``output``'s gradient is known: ``[position,
        share, ...]``, whose share (per sample) an op's own backward may scale (a layer norm by
        the correlation of its gradient with ``x_hat``, :func:`relayed_by_norm`)."""
        relays: list[list] = []
        if not (self.collecting and output.requires_grad and type(output) is torch.Tensor):
            return relays
        position = self._position
        self._position += 1
        fresh = []
        for entry in slots:
            i, scale = entry if isinstance(entry, tuple) else (entry, None)
            if i < len(self._fresh):
                fresh.append((self._fresh[i], scale))
        if not fresh and size is None:
            return relays

        def hook(grad: torch.Tensor) -> None:
            with torch.no_grad():
                g = grad.detach().float()
                rows = g.reshape(g.shape[0], -1) if g.dim() > 1 else g.reshape(1, -1)
                per_row = rows.square().sum(1)
                total = per_row.sum()
                if size is not None:
                    self._sizes.append((position, total * size))
                for s, scale in fresh:
                    if s.samples > 1 and per_row.numel() == s.samples:
                        w = per_row
                    else:
                        w = (total / s.samples).expand(s.samples)
                    if scale is not None:
                        w = w * scale
                    if relayed:
                        share = w / total.clamp_min(1e-30)
                        entry = [position, share * factor, None, None, reach_all]
                        if norm is not None:
                            count = g.numel() // max(norm[0].numel(), 1)
                            entry[2] = share * (factor * factor / count)  # noise x noise
                            coherent = norm[2]
                            if coherent is not None:  # shared by the channel's elements
                                dims = norm[1]
                                per_channel = g.square().sum(dim=dims)
                                entry[3] = share * (coherent * per_channel).sum()
                        s.relayed.append(entry)
                        relays.append(entry)
                    else:
                        w = w * factor
                        s.direct = w if s.direct is None else s.direct + w
                if norm is not None and relays:
                    _correlate(norm, g, relays)

        output.register_hook(hook)
        return relays

    # -- allocation ----------------------------------------------------------------------------

    def splits_samples(self, t: torch.Tensor) -> bool:
        """Would ``t`` (2-d, its rows the batch's samples) get bits per sample? (Its rows
        then stay whole groups: grouping it by feature would mix the samples.)"""
        return t.dim() == 2 and self._samples(t) > 1

    def _samples(self, t: torch.Tensor) -> int:
        n = int(t.shape[0]) if t.dim() >= 2 else 1
        batch = self._batch or n  # (unset before a step's first plan, which sets it to n)
        if not self.per_sample or n <= 1 or n != batch or t.stride(0) != t.numel() // n:
            return 1
        return n

    def _fold(self) -> None:
        """Estimate each slot's cost from the statistics step (one transfer to the host):
        ``C_n = noise_n / numel_n * (direct_n + sum over relays of share_n * below)``, where
        ``below`` is the summed size of the weight gradients before the relaying op."""
        fresh, self._fresh = self._fresh, []
        sizes, self._sizes = self._sizes, []
        if not fresh or all(s.direct is None and not s.relayed for s in fresh):
            return  # no backward ran (evaluation): nothing learned
        tensors: list[torch.Tensor] = [torch.stack([v for _, v in sizes]).reshape(-1)
                                       if sizes else torch.zeros(0)]
        gradient = [True]  # per entry of tensors: read off the step's gradients
        for s in fresh:
            tensors.append(s.noise if s.noise is not None else torch.zeros(s.samples))
            tensors.append(s.direct if s.direct is not None else torch.zeros(s.samples))
            tensors.append(s.score if s.score is not None else torch.zeros(s.samples))
            gradient += [False, True, False]
            for _, lin, quad, coherent, _ in s.relayed:
                tensors.append(lin)
                tensors.append(quad if quad is not None else torch.zeros(s.samples))
                tensors.append(coherent if coherent is not None else torch.zeros(s.samples))
                gradient += [True, True, True]
        device = next((t.device for t in tensors if t.device.type != "cpu"), None)
        flat = torch.cat([t.reshape(-1).float().to(device or "cpu") for t in tensors])
        raw = flat.double().cpu().numpy()
        from_gradient = np.repeat(gradient, [t.numel() for t in tensors])
        if not np.isfinite(raw[from_gradient]).all():
            # the step's gradients overflowed (a mixed-precision loss scale too high for it,
            # a diverging step): they price nothing; the widths stay and the next step
            # collects again
            self._force = True
            return
        values = np.nan_to_num(raw, nan=0.0, posinf=0.0)  # (a saved tensor's own inf)
        at = len(sizes)
        size_at = np.zeros(self._position + 1)
        for (pos, _), v in zip(sizes, values[:at], strict=True):
            size_at[pos] += v
        below = np.concatenate([[0.0], np.cumsum(size_at)])  # below[p]: sizes before p
        nearest = _nearest_below(size_at)
        for s in fresh:
            k = s.samples
            noise, direct = values[at:at + k], values[at + k:at + 2 * k]
            score = values[at + 2 * k:at + 3 * k]
            at += 3 * k
            weight = direct.copy()
            quad = np.zeros(k)
            for pos, *_, reach_all in s.relayed:
                reach = below[pos] if reach_all else nearest[pos]
                weight += values[at:at + k] * reach + values[at + 2 * k:at + 3 * k]
                quad += values[at + k:at + 2 * k] * reach
                at += 3 * k
            sigma2 = noise / s.per_sample_numel
            cost, quartic = sigma2 * weight, sigma2 * sigma2 * quad
            # by the rank forward gives a sample (its norm, times its remembered gradient
            # size; this step's gradient is not known yet), as the expected cost at each
            # rank: a non-increasing fit
            order = np.argsort(-score, kind="stable")
            s.cost, s.quartic = non_increasing(cost[order]), non_increasing(quartic[order])
            s.noise, s.direct, s.relayed, s.score = None, None, [], None
        self.slots = fresh
        self.allocate()

    def allocate(self) -> None:
        """Allocate bits to the known slots from their estimated costs. A tensor kept with
        exact zeros (a ReLU output) that no op reads beyond its zeros gets 0: a 1-bit mask,
        outside the budget like every other mask."""
        for s in self.slots:
            if s.zero_code and not s.cost.any():
                s.bits = np.zeros(s.samples, dtype=np.int64)
        slots = [s for s in self.slots if s.bits is None or s.bits.any()]
        if slots:
            costs = np.concatenate([s.cost for s in slots])
            quartic = np.concatenate([_quartic(s) for s in slots])
            numel = np.concatenate([np.full(s.samples, s.per_sample_numel) for s in slots])
            lo = np.concatenate([np.full(s.samples, s.min_bits) for s in slots])
            # the budget: avg_bits for every saved tensor, a shared slot's once per tensor
            shared = sum(s.numel * s.shares for s in slots)
            avg = min(self.avg_bits * shared / numel.sum(), float(CHOICES[-1]))
            if (lo * numel).sum() > avg * numel.sum():  # a budget under the floors
                lo = np.concatenate([np.full(s.samples, 2 if s.zero_code else 1)
                                     for s in slots])  # (derivatives may then take 1)
            bits = allocate(costs, numel, avg, lo, quartic)
            at = 0
            for s in slots:
                s.bits = np.sort(bits[at:at + s.samples])[::-1].copy()  # most to largest C
                at += s.samples
        self.reallocations += 1

    # -- what it knows -------------------------------------------------------------------------

    @property
    def variance(self) -> float:
        """The model's quantization variance at the allocated bits (0 before any)."""
        return sum(objective(s.cost, s.bits, _quartic(s)) for s in self.slots
                   if s.bits is not None and s.bits.any())

    def uniform_variance(self, bits: int | None = None) -> float:
        """The model's variance with every tensor at ``bits`` (default: the average, rounded
        down to a packable width)."""
        out = 0.0
        for s in self.slots:
            if s.cost is not None and s.cost.any():
                b = max(bits or widest(self.avg_bits), s.min_bits)
                out += float(s.cost.sum()) * NOISE[b] + float(_quartic(s).sum()) * NOISE4[b]
        return out

    @property
    def mean_bits(self) -> float:
        """Allocated bits per saved element (a shared slot's elements counted once per
        saved tensor it serves)."""
        num = sum(float((s.bits * s.per_sample_numel).sum()) for s in self.slots
                  if s.bits is not None)
        den = sum(s.numel * s.shares for s in self.slots
                  if s.bits is not None and s.bits.any())
        return num / den if den else 0.0

    def rows(self) -> list[dict]:
        """One row per slot: its shape, bits (mean and per rank), cost and variance."""
        out = []
        for i, s in enumerate(self.slots):
            if s.bits is None:
                continue
            out.append({"slot": i, "shape": s.label, "numel": s.numel, "shares": s.shares,
                        "bits": float(s.bits.mean()),
                        "bits_by_rank": [[int(b), int(k)] for b, k in _runs(s.bits)],
                        "cost": float(s.cost.sum()),
                        "variance": objective(s.cost, s.bits, _quartic(s))})
        return out

    def state_dict(self) -> dict:
        """Everything needed to resume: settings, counters, and each slot's estimate and bits."""
        return {"avg_bits": self.avg_bits, "every": self.every, "per_sample": self.per_sample,
                "steps": self.steps, "reallocations": self.reallocations,
                "sensitivity": None if self.sensitivity is None else self.sensitivity.cpu(),
                "slots": [{"label": s.label, "numel": s.numel, "samples": s.samples,
                           "min_bits": s.min_bits, "zero_code": s.zero_code,
                           "shares": s.shares,
                           "cost": None if s.cost is None else s.cost.tolist(),
                           "quartic": None if s.quartic is None else s.quartic.tolist(),
                           "bits": None if s.bits is None else s.bits.tolist()}
                          for s in self.slots]}

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned."""
        self.avg_bits = float(state["avg_bits"])
        self.every = int(state["every"])
        self.per_sample = bool(state["per_sample"])
        self.steps = int(state["steps"])
        self.reallocations = int(state["reallocations"])
        table = state.get("sensitivity")
        self.sensitivity = None if table is None else torch.as_tensor(table, dtype=torch.float32)
        self.slots = [_Slot(d["label"], int(d["numel"]), int(d["samples"]), int(d["min_bits"]),
                            bool(d.get("zero_code", int(d["min_bits"]) == 2)),
                            None if d["cost"] is None else np.asarray(d["cost"], np.float64),
                            None if d.get("quartic") is None else np.asarray(d["quartic"],
                                                                             np.float64),
                            None if d["bits"] is None else np.asarray(d["bits"], np.int64),
                            shares=int(d.get("shares", 1)))
                      for d in state["slots"]]
        self._fresh = []


def _correlate(norm: tuple[torch.Tensor, tuple[int, ...]], grad: torch.Tensor,
               entries: list[list]) -> None:
    """Scale relayed batch-norm entries, once the weight's gradient is known, by
    ``mean_c(corr(grad, x_hat)**2) + 1 / M`` (see :meth:`AutoPrecision.watch`)."""
    weight, dims = norm[0], norm[1]
    count = grad.numel() // max(weight.numel(), 1)  # M: elements per channel
    grad_sq = grad.square().mean(dim=dims)  # mean over the channel of grad**2
    handle = None

    def on_weight(grad_weight: torch.Tensor) -> None:
        handle.remove()
        with torch.no_grad():
            mean_gx = grad_weight.detach().float() / count  # mean(grad * x_hat) per channel
            corr = (mean_gx.square() / grad_sq.clamp_min(1e-30)).clamp(max=1.0).mean()
            for entry in entries:
                entry[1] = entry[1] * (corr + 1.0 / count)

    handle = weight.register_hook(on_weight)


def relayed_by_norm(relays: list[list], grad: torch.Tensor, x_hat: torch.Tensor,
                    weight: torch.Tensor | None, ndims: int) -> None:
    """Scale a layer (or RMS) norm's relayed entries (:meth:`AutoPrecision.watch`) by what of
    ``x_hat``'s noise ``e`` its backward passes on. Per row of ``M`` features,
    ``dx = rstd * (gh - mean(gh) - x_hat * mean(gh * x_hat))`` with ``gh = grad * weight``
    reads ``x_hat`` only in its last term, so ``e`` adds ``rstd * (e * m + x_hat * mean(gh * e))``,
    ``m = mean(gh * x_hat)``: expected square ``rstd**2 var(e) (M m**2 (1 + 2 / M) +
    mean(gh**2) mean(x_hat**2))``, where the share assumed ``rstd**2 var(e) M mean(gh**2)``:
    about ``corr(gh, x_hat)**2 + 1 / M``, as for a batch norm's channels (docs/autoprec.md).
    Per sample where the entries are (rows summed), else over the whole tensor."""
    with torch.no_grad():
        dims = tuple(range(grad.dim() - ndims, grad.dim()))
        g, xh = grad.detach().float(), x_hat.detach().float()
        gh = g if weight is None else g * weight.detach().float()
        count = math.prod(grad.shape[d] for d in dims)
        m = (gh * xh).mean(dims)
        v = gh.square().mean(dims)
        passed = m.square() * (count + 2) + v * xh.square().mean(dims)
        assumed = v * count
        for entry in relays:
            samples = entry[1].numel()
            if samples > 1 and passed.dim() >= 1 and passed.shape[0] == samples:
                num = passed.reshape(samples, -1).sum(1)
                den = assumed.reshape(samples, -1).sum(1)
            else:
                num, den = passed.sum(), assumed.sum()
            entry[1] = entry[1] * (num / den.clamp_min(1e-30)).clamp(max=1.0)


def row_noise(t: torch.Tensor, samples: int, group: int) -> torch.Tensor:
    """:func:`rounding_noise` of ``t`` were it packed in groups of ``group`` elements in its
    row-major order (its rows' groups, as per-sample widths pack them), from its values: ``sum``
    over groups of ``G * range**2 / 6``, per sample. Stays on the device."""
    flat = t.detach().float().reshape(-1)
    pad = -flat.numel() % group
    if pad:  # (the last group's own values: its range unchanged)
        flat = torch.cat([flat, flat[-1:].expand(pad)])
    groups = flat.view(-1, group)
    per_group = (groups.amax(1) - groups.amin(1)).square() * (group / 6.0)
    if samples > 1 and (t.numel() // samples) % group == 0:
        return per_group.view(samples, -1).sum(1)
    return (per_group.sum() / samples).expand(samples)


def rounding_noise(packed: PackedTensor | PackedSamples | PackedRows, samples: int) -> torch.Tensor:
    """Per sample, the variance stochastic rounding adds at one bit, from the packed metadata:
    ``sum`` over groups of ``G * range**2 / 6`` (``range`` = step * (levels - 1)); spread
    evenly over the samples where groups do not line up with them. Stays on the device."""
    if isinstance(packed, PackedSamples):
        out = torch.zeros(samples, device=packed.device)
        for idx, part in packed.parts:
            out.index_copy_(0, idx, rounding_noise(part, idx.numel()))
        return out
    steps = group_steps(packed)
    if isinstance(packed, PackedRows):  # each row (sample) at its own width
        row_levels = (2 ** packed.row_bits.to(torch.int64) - 1 - int(packed.zero_code)).float()
        levels = row_levels.repeat_interleave(steps.numel() // row_levels.numel())
    else:
        levels = 2**packed.bits - 1 - int(packed.zero_code)
    per_group = (steps * levels).square() * (packed.group_size / 6.0)
    numel = math.prod(packed.shape)
    # (the column layout's groups come a row block of every feature at a time)
    unit = packed.group_size * (packed.shape[-1] if getattr(packed, "by_feature", False) else 1)
    if samples > 1 and (numel // samples) % unit == 0:
        return per_group.view(samples, -1).sum(1)
    return (per_group.sum() / samples).expand(samples)


def _nearest_below(size_at: np.ndarray) -> np.ndarray:
    """``out[p]``: the size of the last matmul at a position before ``p`` (0 if none), where
    ``size_at[q]`` is the size of the matmul at position ``q`` (0: no matmul there)."""
    padded = np.concatenate([[0.0], size_at])
    last = np.maximum.accumulate(np.where(padded > 0, np.arange(padded.size), 0))
    return padded[last]


def _quartic(s: _Slot) -> np.ndarray:
    return s.quartic if s.quartic is not None else np.zeros_like(s.cost)


def _runs(bits: np.ndarray) -> list[tuple[int, int]]:
    """[(bits, count)] runs of a sequence sorted largest first."""
    out: list[tuple[int, int]] = []
    for b in bits.tolist():
        if out and out[-1][0] == b:
            out[-1] = (b, out[-1][1] + 1)
        else:
            out.append((int(b), 1))
    return out
