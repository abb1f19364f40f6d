"""The CUDA kernels against the CPU reference, byte for byte, then their throughput.

    python scripts/gpu_kernels.py [--numel N] [--no-speed] [--quick]

Part of scripts/gpu_check.sh. Every bit width, float32 and float64, a size that is a whole
number of groups and one that is not, all four kernel options; the bytes and metadata must be
identical to the CPU kernels'; several small tensors in one launch (quantize_many) identical
to the CPU's one call. Then pack and unpack through actune.quantize / dequantize
against torch clone of the same tensor (a bandwidth ceiling). With NUMBA_ENABLE_CUDASIM=1
(and --numel small, --no-speed) the comparison runs in numba-cuda's simulator; --quick there
keeps float32 and the size with a tail group (12 cases: the simulator takes seconds a launch).
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
from numba import cuda

from actune_kernels import cpu, layout
from actune_kernels import cuda as kcuda

GROUP = layout.DEFAULT_GROUP_SIZE


def compare(numel: int, quick: bool = False) -> bool:
    """Pack and unpack on both devices; print and return whether all bytes agree (``quick``:
    float32 and the size with a tail group only)."""
    ok = True
    rng = np.random.default_rng(0)
    for dtype in (np.float32,) if quick else (np.float32, np.float64):
        for n in (numel + 77,) if quick else (numel, numel + 77):
            x = rng.standard_normal(n).astype(dtype)
            x[::5] = np.maximum(x[::5], 0)
            g = layout.num_groups(n, GROUP)
            for bits in (1, 2, 4, 8):
                for stochastic, zero_code in ((True, False), (False, False), (True, bits > 1)):
                    c_ref = np.empty(layout.codes_nbytes(n, bits, GROUP), np.uint8)
                    m_ref = np.empty((g, 2), np.uint16)
                    cpu.pack(x, c_ref, m_ref, bits, GROUP, 5, 3, stochastic, zero_code)
                    c, m = cuda.device_array_like(c_ref), cuda.device_array_like(m_ref)
                    kcuda.pack(cuda.to_device(x), c, m, bits, GROUP, 5, 3, stochastic,
                               zero_code)
                    y_ref = np.empty(n, dtype)
                    cpu.unpack(c_ref, m_ref, bits, GROUP, y_ref, zero_code)
                    y = cuda.device_array(n, dtype)
                    kcuda.unpack(cuda.to_device(c_ref), cuda.to_device(m_ref), bits, GROUP, y,
                                 zero_code)
                    same = (np.array_equal(c.copy_to_host(), c_ref)
                            and np.array_equal(m.copy_to_host(), m_ref)
                            and np.array_equal(y.copy_to_host(), y_ref))
                    ok &= same
                    print(f"{np.dtype(dtype).name} n={n} bits={bits} stochastic={stochastic} "
                          f"zero_code={zero_code}: {'identical' if same else 'DIFFERENT'}")
    return ok


def compare_many() -> bool:
    """quantize_many / dequantize_many of small tensors (mixed dtypes, widths, zero codes) in
    one launch on the GPU: the same bytes and values as the CPU's one call."""
    import torch

    import actune

    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(n, generator=g) for n in (1000, 300, 4096, 1)]
    xs[1] = xs[1].relu().bfloat16()
    widths, zeros = [2, 4, 8, 1], [False, True, False, False]
    on_cpu = actune.quantize_many(xs, widths, seed=7, zero_code=zeros)
    on_gpu = actune.quantize_many([x.cuda() for x in xs], widths, seed=7, zero_code=zeros)
    same = all(torch.equal(a.codes, b.codes.cpu()) and torch.equal(a.meta, b.meta.cpu())
               for a, b in zip(on_cpu, on_gpu, strict=True))
    same &= all(torch.equal(a, b.cpu()) for a, b in zip(
        actune.dequantize_many(on_cpu), actune.dequantize_many(on_gpu), strict=True))
    print(f"quantize_many / dequantize_many, 4 tensors in one launch: "
          f"{'identical to the CPU' if same else 'DIFFERENT from the CPU'}")
    return same


def speed(numel: int) -> None:
    """Elements per second of pack and unpack relative to torch clone, on the GPU."""
    import torch

    import actune

    x = torch.randn(numel, device="cuda")

    def rate(fn, reps: int = 20) -> float:
        fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        return numel * reps / (time.perf_counter() - t)

    small = torch.randn(4096, device="cuda")  # GPU work negligible: the host's time
    actune.quantize(small, 2)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(2000):
        actune.quantize(small, 2)
    host = (time.perf_counter() - t) / 2000
    torch.cuda.synchronize()
    print(f"host time per launch: quantize of 4,096 elements {host * 1e6:.1f} us a call")
    smalls = [torch.randn(1024 * 2 ** (i % 4), device="cuda") for i in range(25)]
    for fn in ("one", "many"):
        t = time.perf_counter()
        for _ in range(200):
            if fn == "one":
                [actune.dequantize(p) for p in [actune.quantize(y, 2) for y in smalls]]
            else:
                actune.dequantize_many(actune.quantize_many(smalls, 2))
        torch.cuda.synchronize()
        print(f"25 tensors of 1,024-8,192 elements packed and unpacked, "
              f"{'one launch a tensor' if fn == 'one' else 'one launch for all'}: "
              f"{(time.perf_counter() - t) / 200 * 1e6:.0f} us")
    clone = rate(lambda: x.clone())
    print(f"torch clone: {clone / 1e9:.1f} Gelem/s ({numel:,} float32)")
    for bits in (1, 2, 4, 8):
        p = actune.quantize(x, bits)
        pack = rate(lambda b=bits: actune.quantize(x, b))
        unpack = rate(lambda p=p: actune.dequantize(p))
        print(f"{bits}-bit: pack {pack / 1e9:.1f} Gelem/s = {pack / clone:.2f}x clone, "
              f"unpack {unpack / 1e9:.1f} Gelem/s = {unpack / clone:.2f}x clone")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=1 << 24)
    ap.add_argument("--no-speed", action="store_true")
    ap.add_argument("--quick", action="store_true",
                    help="float32 and one size (a tail group): for the simulator")
    args = ap.parse_args()
    ok = compare(args.numel, args.quick)
    if not args.no_speed:  # (torch on a real GPU; the simulator runs the kernels alone)
        ok &= compare_many()
    print("all identical" if ok else "SOME DIFFER")
    if not args.no_speed:
        speed(64 << 20)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
