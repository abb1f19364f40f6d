#!/usr/bin/env bash
# The checks that need a GPU, in one run of under 8 minutes: writes everything to OUT.
#   bash scripts/gpu_check.sh OUT
# 1. the CUDA kernels against the CPU reference, byte for byte, on large tensors;
# 2. kernel throughput against torch clone on the GPU;
# 3. actune maxbatch --mode measure at L0 and L3 on ResNet-50 (real OOMs, subprocess probes);
# 4. estimated against measured peak per level;
# 5. bench L0-L5;
# 6. training on digits at L0, L3 and mixed precision on the GPU (allocator statistics there).
set -euo pipefail
out=${1:?usage: scripts/gpu_check.sh OUT}
mkdir -p "$out"
python - <<'PY' 2>&1 | tee "$out/kernels.txt"
import time, numpy as np, torch
from numba import cuda
from actune_kernels import cpu, cuda as kcuda, layout
for bits in (1, 2, 4, 8):
    for n in (1 << 24, (1 << 24) + 77):
        x = torch.randn(n, generator=torch.Generator().manual_seed(bits))
        g = layout.num_groups(n, 256)
        c_cpu = np.empty(layout.codes_nbytes(n, bits, 256), np.uint8)
        m_cpu = np.empty((g, 2), np.uint16)
        cpu.pack(x.numpy(), c_cpu, m_cpu, bits, 256, seed=5)
        xd = x.cuda()
        c = torch.empty(c_cpu.shape, dtype=torch.uint8, device="cuda")
        m = torch.empty((g, 2), dtype=torch.int16, device="cuda")
        kcuda.pack(cuda.as_cuda_array(xd), cuda.as_cuda_array(c),
                   cuda.as_cuda_array(m).view(np.uint16), bits, 256, 5)
        torch.cuda.synchronize()
        same = np.array_equal(c.cpu().numpy(), c_cpu) and np.array_equal(
            m.cpu().numpy().view(np.uint16), m_cpu)
        print(f"bytes identical bits={bits} n={n}: {same}")
import actune
x = torch.randn(64 << 20, device="cuda")
def rate(fn, reps=20):
    fn(); torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(reps): fn()
    torch.cuda.synchronize(); return x.numel() * reps / (time.perf_counter() - t)
clone = rate(lambda: x.clone())
print(f"clone {clone / 1e9:.1f} Gelem/s")
for bits in (1, 2, 4, 8):
    p = actune.quantize(x, bits)
    print(f"pack {bits}-bit {rate(lambda: actune.quantize(x, bits)) / clone:.2f}x clone, "
          f"unpack {rate(lambda: actune.dequantize(p)) / clone:.2f}x clone")
PY
actune info | tee "$out/info.txt"
actune maxbatch --model resnet50 --levels L0,L3 --mode measure --multiple-of 8 \
  --json "$out/maxbatch_measure.json" | tee "$out/maxbatch_measure.txt"
actune maxbatch --model resnet50 --levels L0-L5 --mode estimate \
  --json "$out/maxbatch_estimate.json" | tee "$out/maxbatch_estimate.txt"
python - <<'PY' 2>&1 | tee "$out/estimate_vs_measured.txt"
from actune.levels import LEVELS
from actune.tune.probe import Trial
from actune.tune.workload import builtin
wl = builtin("resnet50")
for name, level in LEVELS.items():
    est = Trial(wl, level, {}, "estimate", "cpu", 512).peak(64)
    real = Trial(wl, level, {}, "measure", "cuda").peak(64)
    print(f"{name}: estimate {est.total / 2**20:,.0f} MiB (+{est.host / 2**20:,.0f} host), "
          f"measured {real.total / 2**20:,.0f} MiB, ratio {est.total / real.total:.3f}")
PY
actune bench --model resnet50 --resolution 224 --batch 64 --levels L0-L5 \
  --json "$out/bench.json" | tee "$out/bench.txt"
actune train --device cuda --levels L0,L3,2b,1.25b --epochs 3 --every 10 \
  --json "$out/train.json" | tee "$out/train.txt"
