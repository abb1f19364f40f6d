#!/usr/bin/env bash
# The checks that need a GPU, in one run of under 8.5 minutes (the section limits sum to
# 500 s); results go to the folder OUT:
#   bash scripts/gpu_check.sh OUT
# gpu_check.log (everything printed), at_max.json, bench.json, train.json.
# Sections (each bounded by its own timeout, so one failure does not lose the others):
# 1. the environment (GPU, driver, torch, numba-cuda);
# 2. the CUDA kernels against the CPU reference, byte for byte, on large tensors, their
#    throughput against torch clone on the GPU, and the host time per launch;
# 3. where a compressed step's time goes (scripts/gpu_profile.py: host vs GPU time, syncs;
#    u2 under compressed() and L3 under compress(), its allocator's statistics step included);
# 4. the GPU memory model against the GPU: predicted and measured allocated and reserved
#    peaks, ResNet-50 (batch 64) and GPT-2 small (4 x 512) at L0 and L3, with the
#    allocator's own traces (memory_*.pickle) for a diff by allocation (scripts/gpu_memory.py);
# 5. bench L0-L5 on ResNet-50 (batch 64, 224x224);
# 6. L3 and L0 each at its own max batch on ResNet-50 under 8 GiB (to fit the time) (bench --at-max --mode
#    measure: real OOMs in subprocess probes, then samples/s at each level's max batch);
# 7. torch.compile: the compiled pack's bandwidth against clone, then compiled L0 against
#    compiled L3 (samples/s, max_memory_allocated) for GPT-2 small's shape at 4 layers and
#    ResNet-50 (scripts/gpu_compile.py; a line per model as it finishes);
# 8. attention's rule on every CUDA SDPA backend (math, flash, memory-efficient, cuDNN) in
#    float32 and bfloat16, and Hugging Face GPT-2 small at L0 and L3 (scripts/gpu_transformers.py);
# 9. training on digits at L0, u2, L3 and 1.25 bits on the GPU.
# Runs from a checkout without installing: PYTHONPATH points at it, PYTHON (default python3)
# is the interpreter that holds torch.
set -uo pipefail
out=${1:?usage: scripts/gpu_check.sh OUT}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
log="$out/gpu_check.log"
: >"$log"
actune() { "$PY" -m actune.cli "$@"; }
section() {  # section NAME SECONDS COMMAND...
    local name=$1 limit=$2 t0=$SECONDS rc
    shift 2
    echo "=== $name (limit ${limit}s)" | tee -a "$log"
    timeout --kill-after=10 "$limit" bash -c '"$@"' _ "$@" 2>&1 | tee -a "$log"
    rc=${PIPESTATUS[0]}
    echo "=== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$log"
}

env_report() {
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
    "$PY" - <<'PY'
import numba, numpy, torch
from numba import cuda
if tuple(int(v) for v in numpy.__version__.split(".")[:2]) >= (2, 5):
    print(f"numpy {numpy.__version__}: numba-cuda cannot compile kernels under numpy 2.5 "
          "(np.row_stack is gone); install numpy<2.5 first (a wheel can travel with the check)")
print("python", __import__("sys").version.split()[0], "torch", torch.__version__,
      "numba", numba.__version__, "numpy", numpy.__version__)
try:
    from importlib.metadata import version
    print("numba-cuda", version("numba-cuda"))
except Exception as err:  # the version is a nicety
    print("numba-cuda version unknown:", err)
print("torch sees", torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0))
print("numba sees", cuda.get_current_device().name)
PY
}

kernels() {
    "$PY" scripts/gpu_kernels.py
}

export -f actune env_report kernels
export PY
section environment 25 env_report
section kernels 50 kernels
section profile 45 "$PY" scripts/gpu_profile.py
section memory_model 100 "$PY" scripts/gpu_memory.py --out "$out"
section bench 70 actune bench --model resnet50 --resolution 224 --batch 64 --levels L0-L5 \
    --steps 5 --warmup 2 --json "$out/bench.json"
section at_max 75 actune bench --model resnet50 --resolution 224 --levels L3,L0 --at-max \
    --mode measure --budget 8GiB --steps 3 --warmup 1 --json "$out/at_max.json"
section compile 80 "$PY" scripts/gpu_compile.py --device cuda --layers 4
section transformers 35 "$PY" scripts/gpu_transformers.py --device cuda
section train 20 actune train --device cuda --levels L0,u2,L3,1.25b --epochs 3 \
    --json "$out/train.json"
echo "done after $SECONDS s" | tee -a "$log"
