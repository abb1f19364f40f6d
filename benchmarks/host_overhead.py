"""Host time per saved tensor: what the Python around each compressed tensor costs a step.

A ResNet-18 step on inputs so small that its arithmetic is a minor part of it (batch 2,
8x8 by default) runs at L0 and at ``--level`` with the CPU kernels replaced by no-ops (the
wrappers still allocate codes, metadata and outputs), so what ``--level`` adds over L0's step
is the function mode, the routing, the hooks' bookkeeping and the ``quantize`` /
``dequantize`` wrappers. Divided by the tensors packed in the step (from
``CompressionStats``), it is the host time per saved tensor. Rounds interleave the two so
that a noisy machine slows both alike; medians are printed.

    python benchmarks/host_overhead.py [--batch 2] [--resolution 8] [--rounds 15]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F  # noqa: N812

import actune
from actune.zoo import resnet
from actune_kernels import cpu

#: The step clock (wall time; ``time.thread_time`` times this thread's CPU instead).
CLOCK = time.perf_counter


def no_op_kernels() -> None:
    """Make the CPU kernels return at once: the wrappers still allocate their outputs and
    convert their arguments, as they do around the real kernels."""
    def nothing(*args, **kwargs) -> None:
        return None

    cpu.pack = cpu.unpack = cpu.pack_rows = cpu.unpack_rows = nothing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--resolution", type=int, default=8)
    parser.add_argument("--level", default="L3")
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_flush_denormal(True)  # the no-op kernels leave the unpacked values unset
    model = resnet(18, num_classes=10)  # any input size
    x = torch.randn(args.batch, 3, args.resolution, args.resolution)
    y = torch.randint(0, 10, (args.batch,))
    found: list[actune.CompressionStats] = []

    def step(level: str) -> float:
        t = CLOCK()
        with actune.compressed(level, stats=found.append):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        model.zero_grad(set_to_none=True)
        return CLOCK() - t

    no_op_kernels()
    for _ in range(3):
        step("L0"), step(args.level)
    times: dict[str, list[float]] = {"L0": [], args.level: []}
    for _ in range(args.rounds):
        for level in times:
            times[level].append(step(level))
    packed = found[-1].packed
    l0, lv = (statistics.median(times[k]) for k in ("L0", args.level))
    print(f"resnet18 {args.resolution}x{args.resolution}, batch {args.batch}, "
          f"{torch.get_num_threads()} threads: L0 step {l0 * 1e3:.1f} ms, {args.level} with "
          f"no-op kernels {lv * 1e3:.1f} ms; {packed} tensors packed a step; host time per "
          f"saved tensor {(lv - l0) / max(packed, 1) * 1e6:.0f} us")


if __name__ == "__main__":
    main()
