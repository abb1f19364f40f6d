"""The GPU memory model on the CPU: device profiles, cuBLAS workspaces and op temporaries
against their sources' numbers, the trace an estimate records, the recorded H200 figure, and
the command line (--device-profile, --margin, info)."""

import json

import pytest
import torch
from typer.testing import CliRunner

from actune.cli import app
from actune.memory import DeviceInfo, parse_budget
from actune.memory.gpu_model import GpuModel, StepTrace
from actune.memory.gpu_profiles import (
    PROFILES,
    cublas_workspace_bytes,
    cublaslt_workspace_bytes,
    find_profile,
    profile_for,
)
from actune.memory.gpu_temporaries import CONV_BACKWARD_WORKSPACE, temporary_bytes
from actune.tune.probe import Trial
from actune.tune.sources import from_source

MIB = 2**20
runner = CliRunner()


@pytest.mark.parametrize("capability, env, expected", [
    ((9, 0), {}, 32 * MIB),  # Hopper: :4096:8
    ((10, 0), {}, 32 * MIB),  # Blackwell too
    ((8, 0), {}, 8 * MIB + 128 * 1024),  # :4096:2:16:8
    ((8, 0), {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}, 32 * MIB),
    ((9, 0), {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}, 128 * 1024),
])
def test_cublas_workspace_follows_the_handle_pools_rules(capability, env, expected):
    assert cublas_workspace_bytes(capability, env) == expected


def test_cublaslt_shares_the_cublas_workspace_unless_told_not_to():
    assert cublaslt_workspace_bytes({}) == 0
    assert cublaslt_workspace_bytes({"TORCH_CUBLASLT_UNIFIED_WORKSPACE": "0"}) == MIB


def test_profiles_by_name_and_by_what_nvml_calls_them():
    assert find_profile("H100").capability == (9, 0)
    assert profile_for("NVIDIA H100 80GB HBM3").name == "h100"
    assert profile_for("NVIDIA L40S").name == "l40s" and profile_for("NVIDIA L4").name == "l4"
    assert profile_for("NVIDIA A100-SXM4-40GB").name == "a100-40"
    assert profile_for("Some Other GPU") is None
    with pytest.raises(ValueError, match="h200"):
        find_profile("h300")


def test_a_profiles_budget_is_its_memory_less_the_context_and_nccl():
    h100 = PROFILES["h100"]
    alone = parse_budget(None, DeviceInfo(False), h100)
    assert alone.bytes == h100.memory - h100.context and "h100 profile" in alone.source
    eight = parse_budget(None, DeviceInfo(False), h100, world_size=8)
    assert alone.bytes - eight.bytes == h100.nccl_bytes(8) == 2 * 2 * 16 * 4 * MIB
    half = parse_budget("50%", DeviceInfo(False), h100)
    assert half.bytes == alone.bytes // 2
    assert parse_budget("16GiB", DeviceInfo(False), h100).bytes == 16 * 2**30


def _args(*shapes, dtype=torch.float32):
    return tuple(torch.empty(s, dtype=dtype, device="meta") for s in shapes)


def test_attention_backward_temporaries_follow_flash_attentions_code():
    conv = torch.ops.aten.convolution_backward.default
    grad, inp = _args((8, 64, 56, 56), (8, 64, 56, 56))
    assert temporary_bytes(conv, (grad, inp)) == int(CONV_BACKWARD_WORKSPACE * grad.nbytes)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    # bf16, B=2, H=8, T=200 (rounded to 256), D=40 (rounded to 64); GQA with 2 KV heads
    g, q, k = _args((2, 8, 200, 40), (2, 8, 200, 40), (2, 2, 200, 40), dtype=torch.bfloat16)
    softmax_d, dq_accum = 4 * 2 * 8 * 256, 4 * 2 * 256 * 8 * 64
    expanded = 2 * 2 * 200 * 8 * 40 * 2
    assert temporary_bytes(flash, (g, q, k)) == softmax_d + dq_accum + expanded
    g, q, k = _args((2, 8, 200, 40), (2, 8, 200, 40), (2, 8, 200, 40))  # float32: delta only
    assert temporary_bytes(flash, (g, q, k)) == 4 * 2 * 8 * 200
    assert temporary_bytes(torch.ops.aten.mm.default, _args((4, 4), (4, 4))) == 0


def test_the_model_adds_two_workspaces_only_where_cublas_runs():
    trace = StepTrace([("alloc", 0, MIB), ("alloc", 1, 3 * MIB), ("free", 1)], prefix=1)
    h100 = GpuModel(PROFILES["h100"], env={})
    assert h100.predict(trace).allocated == 4 * MIB
    trace.uses_blas = True
    peak = h100.predict(trace)
    assert peak.workspaces == 2 * 32 * MIB and peak.allocated == 4 * MIB + 64 * MIB
    assert GpuModel(PROFILES["a100-80"], env={}).predict(trace).workspaces == 2 * (
        8 * MIB + 128 * 1024)


def test_the_recorded_trace_holds_the_tracked_tensors_and_is_the_same_every_time():
    """The trace's own peak (tensors alone) is the tracker's; two estimates give the same
    prediction to the byte (keys never reused, gradient sums in place as a plain step)."""
    work = from_source("builtin:tinycnn")
    gpu = GpuModel.for_profile(PROFILES["h100"])
    peaks = []
    for level in ("L0", "L0", "L3"):
        tracked = Trial(work, level, {"resolution": 16}, "estimate", round_to=512).peak(32)
        trial = Trial(work, level, {"resolution": 16}, "estimate", round_to=512, gpu=gpu)
        peaks.append(trial.peak(32))
        events, live, top = trial.meter.last_trace.events, {}, 0
        for e in events:
            if e[0] == "alloc":
                live[e[1]] = e[2] if isinstance(e[1], int) and e[1] >= 0 else 0
            else:
                live.pop(e[1], None)
            top = max(top, sum(live.values()))
        assert top == tracked.total, level
    assert peaks[0] == peaks[1]
    assert peaks[0].reserved >= peaks[0].total > 0


def test_resnet50_on_the_h200_reproduces_the_measured_l0_peak():
    """The one GPU measurement whose step has not changed since (docs/benchmarks.md):
    ResNet-50, batch 64, 224x224, L0, max_memory_allocated 5,582 MiB on an H200. Tensors
    alone estimate 0.984 of it; with two 32 MiB cuBLAS workspaces and the allocator's
    rules the model must land within [1.00, 1.05]."""
    work = from_source("builtin:resnet50")
    gpu = GpuModel.for_profile(PROFILES["h200"])
    peak = Trial(work, "L0", {"resolution": 224}, "estimate", round_to=512, gpu=gpu).peak(64)
    assert 1.00 <= peak.total / (5582 * MIB) <= 1.05
    assert peak.reserved >= peak.total


def test_maxbatch_for_a_device_profile_says_which_and_carries_both_peaks(tmp_path):
    out = tmp_path / "r.json"
    done = runner.invoke(app, ["maxbatch", "--model", "tinycnn", "--levels", "L0,L3",
                               "--device-profile", "l4", "--budget", "64MiB",
                               "--json", str(out)])
    assert done.exit_code == 0, done.output
    assert "NVIDIA L4 (profile l4)" in done.output and "reserved" in done.output
    assert "less a 5% margin" in done.output
    data = json.loads(out.read_text())
    assert data["device_profile"] == "l4" and data["margin"] == 0.05
    assert data["budget_bytes"] == int(64 * MIB * 0.95)
    for row in data["levels"]:
        assert row["value"] and row["reserved_bytes"] >= row["peak_bytes"] > 0
        assert row["reserved_bytes"] <= data["budget_bytes"]


@pytest.mark.parametrize("argv, message", [
    (["--device-profile", "h300"], "no device profile 'h300'"),
    (["--device-profile", "h100", "--mode", "measure"], "use --mode estimate"),
])
def test_bad_device_profiles_say_what_to_do(argv, message):
    done = runner.invoke(app, ["maxbatch", "--model", "tinycnn", "--levels", "L0", *argv])
    assert done.exit_code == 2 and message in done.output


def test_bad_allocator_settings_exit_2(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:maybe")
    done = runner.invoke(app, ["maxbatch", "--model", "tinycnn", "--levels", "L0",
                               "--device-profile", "h100"])
    assert done.exit_code == 2 and "write True or False" in done.output


def test_info_lists_the_device_profiles():
    done = runner.invoke(app, ["info"])
    assert done.exit_code == 0
    assert "h100" in done.output and "--device-profile" in done.output
