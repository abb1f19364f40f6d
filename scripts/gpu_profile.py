"""Where an L3 training step spends its time on a GPU: host work, launches and synchronisations.

    python scripts/gpu_profile.py [--model resnet50] [--batch 64] [--resolution 224]
                                  [--device cpu]   (a smoke test without a GPU)

Part of scripts/gpu_check.sh. For L0 and u2 (L3's width, no allocator, as the tuner runs it)
under ``actune.compressed``, and for L3 as ``actune.compress(model)`` runs it (its bit
allocator attached): the median step time; the GPU's busy time per step (CUDA events around
the step would include idle gaps, so the profiler's kernel total is used); the synchronising
calls torch reports in one step (``torch.cuda.set_sync_debug_mode``; for L3, also over an
allocator's statistics step and the step after it, whose fold reads the statistics back once);
and the host functions that take the most time (cProfile, three steps). A step whose host
time exceeds its GPU time is launch-bound.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import pstats
import statistics
import sys
import time
import warnings

import torch

import actune
from actune.levels import get_level
from actune.tune.workload import builtin


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--resolution", type=int, default=224)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    cuda = args.device == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    wl = builtin(args.model)
    # (name, level, converted): compressed(level) around the step, or compress(model, level)
    for name, level_name, converted in (("L0", "L0", False), ("u2", "u2", False),
                                        ("L3 compress()", "L3", True)):
        level = get_level(level_name)
        torch.manual_seed(0)
        with torch.device(args.device):
            model = wl.model(resolution=args.resolution)
            opt = wl.optimizer(model.parameters())
            x, y = wl.make_batch(args.batch, args.resolution)
        if converted:
            actune.compress(model, level)

        def step(model=model, opt=opt, x=x, y=y, level=level, converted=converted) -> None:
            opt.zero_grad(set_to_none=True)
            with contextlib.nullcontext() if converted else actune.compressed(level):
                loss = wl.loss(model(x), y)
            loss.backward()
            opt.step()

        for _ in range(3):
            step()
        sync()
        times = []
        for _ in range(5):
            t = time.perf_counter()
            step()
            sync()
            times.append(time.perf_counter() - t)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            step()
            sync()
        gpu_us = sum(e.self_device_time_total for e in prof.key_averages())
        syncs = synchronising(step, 1, cuda)
        print(f"{name}: step {statistics.median(times) * 1e3:.1f} ms, GPU busy "
              f"{gpu_us / 1e3:.1f} ms, synchronising calls in one step: {len(syncs)}")
        for s in sorted(set(syncs))[:5]:
            print(f"    {s}")
        if converted:
            actune.autoprec_of(model).collect_next()
            syncs = synchronising(step, 2, cuda)
            print(f"{name}: synchronising calls in a statistics step and the next: {len(syncs)}")
            for s in sorted(set(syncs))[:5]:
                print(f"    {s}")
        if name != "L0":
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(3):
                step()
            sync()
            pr.disable()
            out = io.StringIO()
            pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(25)
            print(out.getvalue())
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
        del model, opt, x, y
        if cuda:
            torch.cuda.empty_cache()
    return 0


def synchronising(step, steps: int, cuda: bool) -> list[str]:
    """The first line of each synchronisation torch reports over ``steps`` calls of ``step``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                step()
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
    if cuda:
        torch.cuda.synchronize()
    return [str(w.message).splitlines()[0] for w in caught
            if "synchroniz" in str(w.message).lower()]


if __name__ == "__main__":
    sys.exit(main())
