"""The GPU memory model against the GPU: predicted and measured peaks, allocated and reserved.

For ResNet-50 (batch 64, 224x224) and GPT-2 small (docs/examples/hf_gpt2.py, batch 4 x 512)
at L0 and L3: the estimate through the GPU model of the device found (its profile, cuBLAS
workspaces, op temporaries, the caching allocator's rules) against ``max_memory_allocated``
and ``max_memory_reserved`` of a real step in a fresh process, whose allocator trace
(``torch.cuda.memory._record_memory_history``) is written to ``--out`` for a diff by
allocation. The largest blocks alive at each peak are printed side by side.

    python scripts/gpu_memory.py [--device cuda] [--out DIR]

Part of scripts/gpu_check.sh. On a CPU (``--device cpu``, a profile named by ``--profile``)
it prints the predictions alone.
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
from pathlib import Path

import torch

from actune.memory.gpu_model import GpuModel
from actune.memory.gpu_profiles import find_profile, profile_of
from actune.tune.probe import Trial
from actune.tune.sources import from_source

MIB = 2**20
CASES = [("builtin:resnet50", {"resolution": 224}, 64),
         ("docs/examples/hf_gpt2.py", {"resolution": 512}, 4)]


def predicted(source, sizes, batch, level, gpu):
    """The model's peaks and the largest blocks alive at its allocated peak."""
    trial = Trial(from_source(source), level, sizes, "estimate", round_to=512, gpu=gpu)
    peak = trial.peak(batch)
    return peak, _largest_at_peak(trial.meter.last_trace.events)


def _largest_at_peak(events, top: int = 8) -> list[int]:
    live, now, best, at_best = {}, 0, -1, []
    for e in events:
        if e[0] == "alloc":
            live[e[1]] = e[2]
            now += e[2]
            if now > best:
                best, at_best = now, sorted(live.values(), reverse=True)[:top]
        elif e[0] == "free":
            now -= live.pop(e[1], 0)
    return at_best


def measured(source, sizes, batch, level, history: Path):
    os.environ["ACTUNE_MEMORY_HISTORY"] = str(history)
    try:
        peak = Trial(from_source(source), level, sizes, "measure", "cuda").peak(batch)
    finally:
        del os.environ["ACTUNE_MEMORY_HISTORY"]
    with open(history, "rb") as f:
        snap = pickle.load(f)
    events = []
    for entry in snap["device_traces"][0]:
        if entry["action"] == "alloc":
            events.append(("alloc", entry["addr"], entry["size"]))
        elif entry["action"] == "free_completed":
            events.append(("free", entry["addr"]))
    return peak, _largest_at_peak(events)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--profile", default="h100", help="on a CPU: the GPU kind to predict")
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--levels", default="L0,L3")
    ap.add_argument("--cases", type=int, default=len(CASES))
    args = ap.parse_args()
    on_gpu = args.device == "cuda"
    if on_gpu:
        _free, total = torch.cuda.mem_get_info()
        profile = profile_of(torch.cuda.get_device_name(0), total,
                             torch.cuda.get_device_capability(0))
    else:
        profile = find_profile(args.profile)
    gpu = GpuModel.for_profile(profile)
    print(f"profile {profile.name}: {profile.describe()}")
    if on_gpu:
        args.out.mkdir(parents=True, exist_ok=True)
    for source, sizes, batch in CASES[:args.cases]:
        for level in args.levels.split(","):
            est, est_top = predicted(source, sizes, batch, level, gpu)
            line = (f"{source} batch {batch} {level}: predicted allocated "
                    f"{est.total / MIB:,.0f} MiB, reserved {est.reserved / MIB:,.0f} MiB")
            if on_gpu:
                history = args.out / f"memory_{Path(source).stem}_{level}.pickle"
                real, real_top = measured(source, sizes, batch, level, history)
                line += (f"; measured {real.total / MIB:,.0f} / {real.reserved / MIB:,.0f} MiB; "
                         f"estimate/measured allocated {est.total / real.total:.3f}, reserved "
                         f"{est.reserved / real.reserved:.3f}")
                print(line)
                print("  largest blocks at the peak (MiB), predicted:",
                      [round(b / MIB, 1) for b in est_top])
                print("  largest blocks at the peak (MiB), measured: ",
                      [round(b / MIB, 1) for b in real_top])
            else:
                print(line + "; measured: no GPU here")
    return 0


if __name__ == "__main__":
    sys.exit(main())
