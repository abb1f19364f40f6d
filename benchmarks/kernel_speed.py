"""Kernel throughput: elements per second of pack / unpack at 1, 2, 4 and 8 bits against
torch's clone of the same tensor and a pure-torch implementation of the same quantization,
all measured in one run on one tensor (ratios, not absolute timings, are the result).

    python benchmarks/kernel_speed.py [--numel 67108864] [--repeat 5] [--isa all|native|avx2]
                                 [--threads N]

``--isa all`` (the default) runs the measurement once per code generation target in its own
process: the host's own (``native``, AVX-512 where the host has it) and AVX2 (numba told to
compile for a Haswell without AVX-512), so one run shows what CPUs without AVX-512 get.
``--threads 1`` runs torch and the kernels on one thread: the kernels' own cost per element
(ns/elem), apart from how a shared host's other cores happen to be loaded.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time

import numba
import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from actune_kernels import cpu, isa, layout

GROUP = 256


def best_seconds(fn, repeat: int) -> float:
    fn()  # warm-up (and JIT compilation)
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def torch_pack(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same per-group stochastic quantization, written with torch operations only."""
    levels = (1 << bits) - 1
    g = x.view(-1, GROUP)
    lo = g.amin(dim=1, keepdim=True)
    scale = (g.amax(dim=1, keepdim=True) - lo).clamp_min(1e-30) / levels
    code = torch.floor((g - lo) / scale + torch.rand_like(g)).clamp_(0, levels).to(torch.uint8)
    per = 8 // bits
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8)
    packed = (code.view(-1, per) << shifts).sum(dim=1, dtype=torch.uint8)
    return packed, lo.half(), scale.half()


def torch_unpack(packed, lo, scale, bits: int) -> torch.Tensor:
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8)
    code = (packed.unsqueeze(1) >> shifts) & ((1 << bits) - 1)
    return code.view(lo.shape[0], GROUP).float() * scale.float() + lo.float()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=64 * 2**20)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--isa", default="all", choices=("all", *isa.TARGETS))
    parser.add_argument("--threads", type=int, default=0,
                        help="threads for torch and the kernels (default: all)")
    args = parser.parse_args()
    if args.isa == "all":
        for target in isa.TARGETS:
            if target == "avx2" and not isa.has("avx2"):
                continue
            cmd = [sys.executable, __file__, "--numel", str(args.numel), "--repeat",
                   str(args.repeat), "--isa", target, "--threads", str(args.threads)]
            subprocess.run(cmd, check=True, env={**os.environ, **isa.codegen_env(target)})
        return
    if args.threads > 0:
        torch.set_num_threads(args.threads)
        numba.set_num_threads(args.threads)
    n = args.numel - args.numel % GROUP
    x = torch.randn(n, generator=torch.Generator().manual_seed(0))
    xn = x.numpy()
    out = np.empty_like(xn)

    rows = []
    clone_s = best_seconds(lambda: x.clone(), args.repeat)
    rows.append(("torch clone", clone_s))
    for bits in layout.SUPPORTED_BITS:
        codes = np.empty(layout.codes_nbytes(n, bits, GROUP), np.uint8)
        meta = np.empty((layout.num_groups(n, GROUP), 2), np.uint16)
        rows.append((f"pack {bits}-bit", best_seconds(
            lambda b=bits, c=codes, m=meta: cpu.pack(xn, c, m, b, GROUP, seed=1), args.repeat)))
        rows.append((f"unpack {bits}-bit", best_seconds(
            lambda b=bits, c=codes, m=meta: cpu.unpack(c, m, b, GROUP, out), args.repeat)))
    import actune

    rows.append(("actune.quantize 2-bit (allocates)",
                 best_seconds(lambda: actune.quantize(x, 2, seed=1), args.repeat)))
    qp = actune.quantize(x, 2, seed=1)
    rows.append(("actune.dequantize 2-bit (allocates)",
                 best_seconds(lambda: actune.dequantize(qp), args.repeat)))
    packed = torch_pack(x, 2)
    rows.append(("pure-torch pack 2-bit", best_seconds(lambda: torch_pack(x, 2), args.repeat)))
    rows.append(("pure-torch unpack 2-bit",
                 best_seconds(lambda: torch_unpack(*packed, 2), args.repeat)))

    table = Table(title=f"{n:,} float32 elements, {torch.get_num_threads()} threads, "
                        f"{platform.processor() or platform.machine()}, kernels compiled "
                        f"for {isa.vector_width()} ({args.isa})")
    table.add_column("operation")
    table.add_column("Gelem/s", justify="right")
    table.add_column("x clone", justify="right")
    table.add_column("ns/elem", justify="right")
    for name, seconds in rows:
        table.add_row(name, f"{n / seconds / 1e9:.2f}", f"{clone_s / seconds:.2f}",
                      f"{seconds / n * 1e9:.3f}")
    Console().print(table)
    secs = dict(rows)
    print(f"2-bit pack vs pure torch:   {secs['pure-torch pack 2-bit'] / secs['pack 2-bit']:.1f}x")
    print(f"2-bit unpack vs pure torch: "
          f"{secs['pure-torch unpack 2-bit'] / secs['unpack 2-bit']:.1f}x")


if __name__ == "__main__":
    main()
