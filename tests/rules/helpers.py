"""Shared checks of the rule tests: a rule's gradient against PyTorch's exact one."""

from __future__ import annotations

import torch

import actune
from actune.levels import Level


def level(bits: int, **extra) -> Level:
    """Every compressed tensor at ``bits``, masks on, nothing too small to pack."""
    return Level(f"t{bits}", matmul_bits=bits, other_bits=bits, masks=True, min_numel=1,
                 **extra)


def input_grads(fn, inputs: tuple[torch.Tensor, ...], lv, draws: int, seed: int = 0):
    """``draws`` gradients of ``sum(fn(*inputs) * g)`` with respect to each input, at ``lv``
    (a fixed random ``g``), stacked: one tensor per input."""
    with torch.no_grad():
        out = fn(*inputs)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(5), dtype=out.dtype)
    samples = []
    for s in range(draws):
        torch.manual_seed(seed + s)
        with actune.compressed(lv):
            y = fn(*inputs)
        samples.append(torch.autograd.grad(y, inputs, g))
    return [torch.stack([s[i] for s in samples]) for i in range(len(inputs))]


def exact_grads(fn, inputs):
    return input_grads(fn, inputs, "L0", 1)


def shrinks_like_noise(samples: torch.Tensor, exact: torch.Tensor, small=8, large=512) -> float:
    """||mean of ``large`` samples - exact|| / ||mean of ``small`` samples - exact||: about
    sqrt(small / large) for unbiased samples (0.125 at 8 and 512), near 1 for biased ones."""
    err = [(samples[:k].mean(0) - exact).norm() for k in (small, large)]
    return (err[1] / err[0]).item()


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


DTYPES = [torch.float32, torch.bfloat16]


def kept_kinds(fn, inputs: tuple[torch.Tensor, ...], lv) -> dict[str, int]:
    """Bytes kept per kind (``"mask"``, ``"derivative"``...) by ``fn(*inputs)`` at ``lv``;
    fails if anything large stayed exact."""
    stats = []
    with actune.compressed(lv, stats=stats.append):
        fn(*inputs)
    assert not stats[0].exact, f"kept exact: {stats[0].exact}"
    return stats[0].by_kind


def check_rule(fn, make, dtype, exact_only=False, shape=(16, 64), tolerance=0.03,
               kind: str | None = None):
    """A unary rule at 8 bits: close to PyTorch's gradient (``tolerance`` in float32); in
    float32 at 2 bits: rounded and unbiased (or, ``exact_only``, PyTorch's exactly). ``kind``:
    what the rule keeps is counted under that kind. Whatever ``kind``, a rule's kind is
    counted and nothing large stays exact: the rule ran (gradients equal to PyTorch's alone
    would also hold with no rule at all)."""
    x = make(torch.randn(shape, generator=torch.Generator().manual_seed(0))).to(dtype)
    x.requires_grad_()
    stats = []
    with actune.compressed(level(2), stats=stats.append):
        fn(x)
    kinds = stats[0].by_kind
    # the rule ran: what it keeps is counted under a kind of its own, and what stays exact
    # (a norm's statistics) is small beside the input
    assert set(kinds) - {"exact"}, f"no rule's kind counted: {kinds}"
    assert sum(stats[0].exact.values()) * 8 <= x.numel() * x.element_size(), stats[0].exact
    if kind is not None:
        assert kinds.get(kind, 0) > 0, f"{kind!r} not counted: {kinds}"
    (exact,) = exact_grads(fn, (x,))
    (eight,) = input_grads(fn, (x,), level(8), 1)
    tolerance = tolerance if dtype == torch.float32 else 0.08
    assert relative_error(eight[0].float(), exact[0].float()) < tolerance
    if dtype != torch.float32:
        return
    (two,) = input_grads(fn, (x,), level(2), 256)
    if exact_only:
        assert torch.equal(two[0], exact[0]) and torch.equal(two[-1], exact[0])
        return
    assert relative_error(two[0], exact[0]) > 1e-3  # it was rounded
    assert shrinks_like_noise(two, exact[0], small=8, large=256) < 0.25
