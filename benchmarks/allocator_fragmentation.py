"""What the CUDA caching allocator wastes per level, predicted on any machine.

For ResNet-50 (224 x 224) and GPT-2 small (``docs/examples/hf_gpt2.py``, 512 tokens) under a
16 GiB budget on a GPU profile (``--device-profile``, H100 by default; the tuner keeps a 5%
margin, so 15.2 GiB), per level: the tuner's answer with the allocator replayed by its rules
(``fits`` = the reserved peak within the budget), the answer an allocator that wastes nothing
would give (the same trace of tensors, cuBLAS workspaces and op temporaries; ``fits`` = the
allocated peak within the budget), their ratio, and reserved / allocated at the answer. L5
runs as the level runs it: expandable segments on (unless ``PYTORCH_CUDA_ALLOC_CONF`` sets
them) and the cache emptied between forward and backward. ``--without-defrag-setting``
replays L5 with the default allocator settings, as before L5 turned them on.

    python benchmarks/allocator_fragmentation.py [--models resnet50,gpt2] [--levels L3,L4,L5]
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from rich.console import Console
from rich.table import Table

from actune.memory.budget import Budget
from actune.memory.gpu_model import GpuModel, GpuPeak
from actune.memory.gpu_profiles import find_profile
from actune.tune import run
from actune.tune.workload import builtin, load

GIB = 2**30
EXAMPLES = Path(__file__).resolve().parents[1] / "docs" / "examples"


@dataclasses.dataclass(frozen=True)
class Unfragmented(GpuModel):
    """The GPU model with an allocator that reserves exactly what is allocated (replayed
    with no capacity, so fragmentation never runs it out of memory)."""

    def predict(self, trace) -> GpuPeak:
        peak = super().predict(trace)
        return dataclasses.replace(peak, reserved=peak.allocated)

    def defragmenting(self) -> GpuModel:
        return self


@dataclasses.dataclass(frozen=True)
class Undefragmented(GpuModel):
    """The GPU model of L5 before it turned expandable segments on."""

    def defragmenting(self) -> GpuModel:
        return self


def workloads(names: list[str]) -> dict:
    out = {}
    for name in names:
        if name == "gpt2":
            out["GPT-2 small, 512 tokens"] = (load(EXAMPLES / "hf_gpt2.py"), {"resolution": 512})
        else:
            out[name] = (builtin(name), {})
    return out


def answers(workload, sizes: dict, levels: list[str], gpu: GpuModel, budget: Budget) -> dict:
    settings = run.Settings(budget, "estimate", "cpu", gpu.profile.title, None, None, gpu, 0.05)
    report = run.maxbatch(workload, levels, settings, sizes=sizes)
    return {row.level: row for row in report.levels}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet50,gpt2")
    parser.add_argument("--levels", default="L3,L4,L5")
    parser.add_argument("--device-profile", default="h100")
    parser.add_argument("--without-defrag-setting", action="store_true")
    args = parser.parse_args()
    levels = args.levels.split(",")
    profile = find_profile(args.device_profile)
    budget = Budget(int(16 * GIB * 0.95), "16 GiB less a 5% margin")
    kind = Undefragmented if args.without_defrag_setting else GpuModel
    gpu = kind(profile, capacity=budget.bytes)
    ideal = Unfragmented(profile, capacity=None)
    table = Table(title=f"max batch under 16 GiB, {profile.title}, estimate"
                  + (" (L5 without expandable segments)" if args.without_defrag_setting else ""))
    for col in ("model", "level", "answer", "no waste", "answer / no waste",
                "reserved / allocated"):
        table.add_column(col, justify="left" if col in ("model", "level") else "right")
    for name, (workload, sizes) in workloads(args.models.split(",")).items():
        real = answers(workload, sizes, levels, gpu, budget)
        best = answers(workload, sizes, levels, ideal, budget)
        for level in levels:
            r, b = real[level], best[level]
            waste = (r.reserved_bytes / r.peak_bytes) if r.reserved_bytes and r.peak_bytes else 0
            table.add_row(name, level, f"{int(r.value):,}", f"{int(b.value):,}",
                          f"{r.value / b.value:.2f}x", f"{waste:.2f}x")
    Console().print(table)


if __name__ == "__main__":
    main()
