"""Checkpointed regions under compressed(): what the recomputation saves is compressed, in
both of torch.utils.checkpoint's modes (actune/session/recompute.py)."""

import pytest
import torch
import torch.utils.checkpoint as checkpoint
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker

import actune
from tests.rules.helpers import level, relative_error, shrinks_like_noise

MODES = {"non-reentrant": False, "reentrant": True}


def blocks(n=4, width=64, hidden=512, norm=True, seed=0):
    torch.manual_seed(seed)
    return nn.ModuleList(nn.Sequential(nn.Linear(width, hidden), nn.ReLU(),
                                       nn.Linear(hidden, width),
                                       nn.LayerNorm(width) if norm else nn.Identity())
                         for _ in range(n))


def run(model, x, lv, reentrant=None):
    """The gradient of every parameter and of ``x`` of a loss of the blocks on ``x`` (each
    checkpointed unless ``reentrant`` is None)."""
    params = [*model.parameters(), x]
    for p in params:
        p.grad = None
    with actune.compressed(lv):
        h = x * 1.0
        for block in model:
            h = (block(h) if reentrant is None
                 else checkpoint.checkpoint(block, h, use_reentrant=reentrant))
        g = torch.randn(h.shape, generator=torch.Generator().manual_seed(9))
        loss = (h * g).sum()
    loss.backward()  # (a reentrant checkpoint does not take autograd.grad)
    return [p.grad for p in params]


def flat(grads):
    return torch.cat([g.reshape(-1) for g in grads])


@pytest.mark.parametrize("mode", list(MODES))
def test_eight_bits_in_the_recomputation_are_close_to_exact(mode):
    model = blocks()
    x = torch.randn(256, 64, requires_grad=True)
    exact = flat(run(model, x, "L0"))
    u8 = actune.get_level("u8")
    got = flat(run(model, x, u8.with_(nonlinear_bits=None), MODES[mode]))  # boundary exact
    assert relative_error(got, exact) < 0.03
    # the boundary rounded (8 bits): the recomputation runs from other inputs, its error
    # shared by every tensor it saves (against SGD's own noise: benchmarks/rule_noise.py)
    rounded = flat(run(model, x, u8, MODES[mode]))
    assert 0.03 < relative_error(rounded, exact) < 0.2


@pytest.mark.parametrize("mode", list(MODES))
def test_two_bits_in_the_recomputation_are_unbiased(mode):
    """With the boundary exact (``nonlinear_bits=None``) the recomputation is PyTorch's own,
    and what it saves is rounded where the backward is linear in it: unbiased."""
    model = blocks(n=2, width=16, hidden=64, norm=False)
    x = torch.randn(32, 16, requires_grad=True)
    exact = flat(run(model, x, "L0"))
    draws = []
    for seed in range(256):
        torch.manual_seed(seed)
        draws.append(flat(run(model, x, level(2), MODES[mode])))
    draws = torch.stack(draws)
    assert relative_error(draws[0], exact) > 1e-3  # it was rounded
    assert shrinks_like_noise(draws, exact, small=8, large=256) < 0.25


def peak_mib(model, x, lv, reentrant):
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        run(model, x, lv, reentrant)
    snap = tracker.get_tracker_snapshot("peak")
    return sum(v.get("Total", 0) for v in snap.values()) / 2**20


@pytest.mark.parametrize("mode", list(MODES))
def test_a_compressed_recomputation_lowers_the_peak(mode):
    """The recomputed region's saved tensors are packed as they are saved: the step's peak
    (inside the recomputation and its backward) falls well below exact checkpointing's."""
    torch.manual_seed(0)
    model = nn.ModuleList(nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(128, 128),
                                                                       nn.ReLU())])
                          for _ in range(2))
    x = torch.randn(4096, 128, requires_grad=True)
    exact_ckpt = peak_mib(model, x, "L0", MODES[mode])
    compressed_ckpt = peak_mib(model, x, "L3", MODES[mode])
    assert compressed_ckpt < 0.75 * exact_ckpt, (compressed_ckpt, exact_ckpt)  # 0.57x, 0.63x


def test_the_boundary_width_is_the_levels_and_named():
    assert actune.get_level("L3").boundary_width == 8  # nonlinear_bits, by default
    assert actune.get_level("L3").with_(boundary_bits=4).boundary_width == 4
    model = blocks(n=2)
    x = torch.randn(256, 64, requires_grad=True)
    st = []
    with actune.compressed(actune.get_level("L3").with_(boundary_bits=4), stats=st.append):
        h = x * 1.0
        for block in model:
            h = checkpoint.checkpoint(block, h, use_reentrant=False)
    boundary = st[0].by_kind["checkpoint boundary"]
    assert boundary < 256 * 64 * 2 * 0.6  # two inputs at 4 bits (and group metadata)
