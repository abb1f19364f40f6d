"""L5 defragments: it turns PyTorch's expandable segments on for its run (unless the user's
allocator configuration says either way), and the GPU model replays an L5 step so: a
ResNet-50 step then reserves about what it allocates."""

import pytest
import torch

import actune
from actune.memory.budget import Budget
from actune.memory.gpu_model import GpuModel
from actune.memory.gpu_profiles import PROFILES
from actune.session import allocator_settings
from actune.session.allocator_settings import user_sets_expandable_segments
from actune.tune.probe import Trial
from actune.tune.run import Settings
from actune.tune.sources import from_source

MIB = 2**20


@pytest.mark.parametrize("env, sets", [
    ({}, False), ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}, False),
    ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}, True),
    ({"PYTORCH_ALLOC_CONF": "max_split_size_mb:64, expandable_segments:True"}, True),
])
def test_the_users_own_setting_is_recognised(env, sets):
    assert user_sets_expandable_segments(env) is sets


@pytest.fixture
def setter(monkeypatch):
    calls: list[str] = []
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", calls.append,
                        raising=False)
    monkeypatch.setattr(allocator_settings, "_enabled", [])
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    return calls


def test_l5_turns_expandable_segments_on_once_and_l4_does_not(setter, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)  # (no cache to empty)
    x = torch.randn(8, 64, requires_grad=True)
    with actune.compressed("L4"):
        (x * 2).sum()
    assert setter == []
    for _ in range(2):
        with actune.compressed("L5"):
            (x * 2).sum()
    assert setter == ["expandable_segments:True"]


def test_l5_leaves_a_users_choice_alone(setter, monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    assert allocator_settings.enable_expandable_segments() is False
    assert setter == []


def test_the_gpu_model_replays_l5_with_expandable_segments_unless_the_user_chose():
    gpu = GpuModel(PROFILES["h100"], env={})
    assert gpu.defragmenting().allocator.expandable_segments
    assert not gpu.allocator.expandable_segments
    chosen = GpuModel(PROFILES["h100"], env={"PYTORCH_CUDA_ALLOC_CONF":
                                             "expandable_segments:False"})
    assert chosen.defragmenting() is chosen
    settings = Settings(Budget(1 << 30, "test"), "estimate", gpu=gpu)
    work = from_source("builtin:tinycnn")
    assert settings.trial(work, "L5", {}).gpu.allocator.expandable_segments
    assert not settings.trial(work, "L4", {}).gpu.allocator.expandable_segments


def test_resnet50_l5_on_the_h100_profile_reserves_within_1_1x_of_what_it_allocates():
    """The same L5 step replayed with expandable segments (as L5 runs) and without (as it ran
    before it turned them on)."""
    work = from_source("builtin:resnet50")
    gpu = GpuModel(PROFILES["h100"], env={})
    settings = Settings(Budget(16 << 30, "test"), "estimate", gpu=gpu)
    now = settings.trial(work, "L5", {"resolution": 64}).peak(128)
    before = Trial(work, "L5", {"resolution": 64}, "estimate", round_to=512, gpu=gpu).peak(128)
    assert now.reserved <= 1.1 * now.total
    assert before.reserved > 1.15 * before.total
