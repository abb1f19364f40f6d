"""Small tensors packed one call each against one call for all (``quantize_many``).

The tensors of a small model's step (ResNet-18 at 8x8, batch 2: 1,024 to 8,192 elements,
float32, 2 bits) are packed and unpacked by ``quantize`` / ``dequantize`` one by one and by
``quantize_many`` / ``dequantize_many`` in one call, alternately in one run; the ratio of the
medians is the result (timings are this thread's CPU time, robust to a shared host's noise).

    python benchmarks/batched_calls.py [--tensors 25] [--rounds 200]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import actune

CLOCK = time.thread_time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=25)
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    sizes = [1024 * 2 ** (i % 4) for i in range(args.tensors)]  # 1,024 to 8,192 elements
    xs = [torch.randn(n, generator=g) for n in sizes]

    def one_by_one():
        return [actune.dequantize(p) for p in [actune.quantize(x, 2) for x in xs]]

    def together():
        return actune.dequantize_many(actune.quantize_many(xs, 2))

    times: dict[str, list[float]] = {"one call a tensor": [], "one call for all": []}
    runs = {"one call a tensor": one_by_one, "one call for all": together}
    for fn in runs.values():
        fn(), fn()  # compile and warm up
    for _ in range(args.rounds):
        for name, fn in runs.items():
            t = CLOCK()
            fn()
            times[name].append(CLOCK() - t)
    one, all_ = (statistics.median(times[k]) for k in runs)
    print(f"{args.tensors} tensors of {min(sizes):,}-{max(sizes):,} elements, 2 bits, pack and "
          f"unpack: one call a tensor {one * 1e6:.0f} us ({one / args.tensors * 1e6:.1f} us a "
          f"tensor), one call for all {all_ * 1e6:.0f} us ({all_ / args.tensors * 1e6:.1f} us "
          f"a tensor): {one / all_:.2f}x faster")


if __name__ == "__main__":
    main()
