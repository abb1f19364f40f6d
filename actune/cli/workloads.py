"""What a command runs on: the workload (a model file, ``--hf``, a built-in model), its data,
and the tuner's settings from the command's options."""

from __future__ import annotations

import dataclasses
import platform
from pathlib import Path

from actune.cli.app import UsageError


def load_workload(model_file: Path | None, model: str, hf: str | None = None,
                  hf_class: str | None = None, precision: str | None = None,
                  lora: int | None = None):
    """The workload (see :func:`_source`) at ``precision`` if given, with LoRA adapters of
    rank ``lora`` if given."""
    work = _source(model_file, model, hf, hf_class)
    if precision is not None:
        from actune.tune.workload import check_precision

        work.precision = check_precision(precision)
    work.lora = lora
    return work


def _source(model_file: Path | None, model: str, hf: str | None = None,
            hf_class: str | None = None):
    """The workload the options name (:func:`actune.tune.sources.resolve`)."""
    from actune.tune.sources import AmbiguousSourceError, resolve

    try:
        return resolve(model_file, model, hf, hf_class)
    except AmbiguousSourceError as err:
        raise UsageError(str(err)) from None


def dataset_and_sizes(work, resolution: int | None):
    """The workload's dataset and the model sizes that go with ``resolution``."""
    try:
        data = work.dataset(resolution)
    except ImportError as err:  # scikit-learn, for the built-in digits
        raise UsageError(str(err)) from None
    return data, ({"resolution": resolution} if resolution and "resolution" in work.dims
                  else {})


def setup(model_file: Path | None, model: str, levels: str, budget: str | None,
           mode: str | None, world_size: int = 1, shard: str = "fsdp",
           jobs: int | None = None, hf: str | None = None, hf_class: str | None = None,
           precision: str | None = None, device_profile: str | None = None,
           margin: float | None = None, lora: int | None = None):
    import torch

    from actune.memory import DeviceInfo, parse_budget, probe
    from actune.tune.alternatives import parse_configs
    from actune.tune.run import Settings

    workload = load_workload(model_file, model, hf, hf_class, precision, lora)
    level_list = parse_configs(levels)
    info = probe()
    cuda = info.available and torch.cuda.is_available()
    mode = mode or ("estimate" if device_profile or not cuda else "measure")
    if mode not in ("estimate", "measure"):
        raise UsageError(f"--mode must be estimate or measure, not {mode!r}")
    if device_profile and mode != "estimate":
        raise UsageError(f"--device-profile {device_profile} estimates for a GPU kind: use "
                          f"--mode estimate (or leave --mode out)")
    from actune.tune.sharding import Sharding

    sharding = Sharding(shard, world_size) if world_size > 1 else None
    if sharding is not None and mode != "estimate":
        raise UsageError(f"--world-size {world_size} gives per-rank estimates: use --mode "
                          f"estimate (or leave --mode out without a GPU)")
    gpu = _gpu_model(device_profile, info if cuda else None) if mode == "estimate" else None
    found = DeviceInfo(False) if device_profile else info  # (a profile: not the GPU here)
    the_budget = parse_budget(budget, found, gpu.profile if gpu else None, world_size)
    margin = (5.0 if gpu else 0.0) if margin is None else margin
    if margin:
        the_budget = dataclasses.replace(
            the_budget, bytes=int(the_budget.bytes * (1 - margin / 100)),
            source=f"{the_budget.source}, less a {margin:g}% margin")
    if gpu is not None:  # the allocator may reserve up to the budget, then frees its cache
        gpu = dataclasses.replace(gpu, capacity=the_budget.bytes)
    name = (f"{gpu.profile.title} (profile {gpu.profile.name})" if device_profile else
            info.name if cuda else f"CPU ({platform.machine()})")
    settings = Settings(the_budget, mode, "cuda" if cuda else "cpu", name, sharding, jobs,
                        gpu, margin / 100)
    workload.check()
    return workload, level_list, settings


def compile_answers(settings, on: bool, backend: str) -> None:
    """maxbatch / scale --compile: the backend the compiled answers use (checked first)."""
    if on:
        check_backend(backend)
        if settings.sharding is not None:
            raise UsageError("--compile measures one process's compiled step: drop "
                              "--world-size")
        settings.compile_backend = backend


def check_backend(name: str) -> None:
    """A torch.compile backend this torch has, or one paragraph naming those it has."""
    import torch._dynamo

    known = {*torch._dynamo.list_backends(), "eager", "aot_eager"}
    if name not in torch._dynamo.list_backends(exclude_tags=()):
        raise UsageError(f"--compile-backend {name!r} is not a torch.compile backend here; "
                          f"choose one of {', '.join(sorted(known))}")


def _gpu_model(name: str | None, found):
    """The GPU model an estimate predicts with: the profile named, else the GPU found (its
    profile, or one made from what CUDA reports), else none."""
    from actune.memory.gpu_model import GpuModel
    from actune.memory.gpu_profiles import find_profile, profile_of

    if name:
        profile = find_profile(name)
    elif found is not None:
        import torch

        profile = profile_of(found.name, found.total, torch.cuda.get_device_capability())
    else:
        return None
    return GpuModel.for_profile(profile)
