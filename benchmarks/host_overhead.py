"""Host time per saved tensor: what the Python around each compressed tensor costs a step.

A ResNet-18 step on inputs so small that its arithmetic is a minor part of it (batch 8,
8x8 by default: every tensor it packs has at least ``min_numel`` elements, so the same 41
are packed whatever the version) runs with the CPU kernels replaced by no-ops (the wrappers
still allocate codes, metadata and outputs). Two comparisons, each divided by the tensors
packed in the step (from ``CompressionStats``):

* ``use``: ``--level`` as a training loop and ``actune bench`` run it (no statistics sink)
  against plain PyTorch (L0, where ``compressed`` does nothing): all that actune adds, the
  function mode and the saved-tensor hooks included;
* ``accounting``: both levels with a statistics sink (L0 then runs the mode and the hooks
  too): the figure this script printed before it had the first line.

Each round runs the four steps in turn and the medians of the per-round differences are
printed (a noisy machine slows neighbouring steps alike), in this thread's CPU time, on
torch's default thread count unless ``--threads`` sets one. The Python calls a step makes
(a profile hook counts them) are printed too: a count the machine's noise does not move.

    python benchmarks/host_overhead.py [--batch 8] [--resolution 8] [--rounds 60]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F  # noqa: N812

import actune
from actune.zoo import resnet
from actune_kernels import cpu

#: The step clock: this thread's CPU time (``time.perf_counter`` for wall time).
CLOCK = time.thread_time


def no_op_kernels() -> None:
    """Make the CPU kernels return at once: the wrappers still allocate their outputs and
    convert their arguments, as they do around the real kernels."""
    def nothing(*args, **kwargs) -> None:
        return None

    cpu.pack = cpu.unpack = cpu.pack_rows = cpu.unpack_rows = nothing


def python_calls(fn) -> int:
    """Python and built-in function calls made while ``fn()`` runs."""
    count = 0

    def profile(frame, event, arg) -> None:
        nonlocal count
        if event in ("call", "c_call"):
            count += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--resolution", type=int, default=8)
    parser.add_argument("--level", default="L3")
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--threads", type=int, default=0, help="0: torch's default")
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)  # the no-op kernels leave the unpacked values unset
    model = resnet(18, num_classes=10)  # any input size
    x = torch.randn(args.batch, 3, args.resolution, args.resolution)
    y = torch.randint(0, 10, (args.batch,))
    found: list[actune.CompressionStats] = []

    def step(level: str, stats: bool) -> float:
        t = CLOCK()
        with actune.compressed(level, stats=found.append if stats else None):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        model.zero_grad(set_to_none=True)
        return CLOCK() - t

    no_op_kernels()
    runs = [("L0", False), (args.level, False), ("L0", True), (args.level, True)]
    for _ in range(3):
        for run in runs:
            step(*run)
    use, accounting = [], []
    for _ in range(args.rounds):
        t = [step(*run) for run in runs]
        use.append(t[1] - t[0])
        accounting.append(t[3] - t[2])
    packed = max(found[-1].packed, 1)
    calls = {run: python_calls(lambda run=run: step(*run)) for run in runs[:2]}
    print(f"resnet18 {args.resolution}x{args.resolution}, batch {args.batch}, "
          f"{torch.get_num_threads()} thread(s), {args.rounds} rounds: {packed} tensors packed "
          f"a step; host time per saved tensor {statistics.median(use) / packed * 1e6:.0f} us "
          f"(use: {args.level} against plain PyTorch), "
          f"{statistics.median(accounting) / packed * 1e6:.0f} us (accounting: both with "
          f"statistics); Python calls a step: plain {calls[runs[0]]:,}, {args.level} "
          f"{calls[runs[1]]:,} ({(calls[runs[1]] - calls[runs[0]]) / packed:.0f} a saved "
          f"tensor)")


if __name__ == "__main__":
    main()
