"""The CUDA kernels: same bytes as the reference in numba-cuda's simulator (own process, small
tensors), and they compile to PTX for sm_80 and sm_90 without a GPU."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from actune_kernels import cuda as kernels
from actune_kernels import scalar


def test_cuda_kernels_match_reference_in_simulator():
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    script = Path(__file__).with_name("cudasim_cases.py")
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 15 and all(line.endswith("same=True") for line in lines)
    assert sum(" blocks=1 " in line for line in lines) >= 3  # warps looping over groups
    assert sum(line.startswith("segments ") for line in lines) == 2  # several in one launch


def test_random_stream_in_32_bit_arithmetic_gives_the_same_bits():
    """The kernels' 32-bit random stream, compiled, against the shared 64-bit definition."""
    import numba
    import numpy as np

    from actune_kernels.cpu_scalar import SCALAR

    fast = numba.njit(scalar.random24_u32)
    slow = SCALAR.random24  # the shared definition, compiled for the CPU
    rng = np.random.default_rng(0)
    keys = rng.integers(0, 2**32, 2000, dtype=np.uint64)
    idx = rng.integers(0, 2**32, 2000, dtype=np.uint64)
    for k, i in zip(keys.tolist(), idx.tolist(), strict=True):
        assert fast(np.uint32(k), np.uint32(i)) == slow(k, i)
    assert fast(np.uint32(2**32 - 1), np.uint32(2**32 - 1)) == slow(2**32 - 1, 2**32 - 1)


@pytest.fixture(scope="module", params=[(8, 0), (9, 0)], ids=["sm_80", "sm_90"])
def ptx(request):
    return request.param, kernels.compile_ptx(request.param)


@pytest.mark.parametrize("name", ["pack", "unpack", "pack_segments", "unpack_segments"])
def test_kernels_compile_to_ptx(ptx, name):
    (major, minor), code = ptx
    assert f".target sm_{major}{minor}" in code[name]
    assert ".entry" in code[name]


@pytest.mark.parametrize("name", ["pack", "pack_segments"])
def test_pack_reduces_with_warp_shuffles(ptx, name):
    """Min, max and the bytes' codes are combined in registers (butterfly shuffles), not
    through shared memory and barriers."""
    code = ptx[1][name]
    assert code.count("shfl.sync.bfly") >= 15  # 5 rounds each for min, max and the flag
    assert "bar.sync" not in code


def test_float64_kernels_compile(ptx):
    code = kernels.compile_ptx(ptx[0], "float64")
    assert "shfl.sync.bfly" in code["pack"] and ".entry" in code["unpack"]


@pytest.mark.parametrize("name", ["pack", "unpack", "pack_segments", "unpack_segments"])
def test_no_fused_multiply_add_so_bytes_match_the_cpu(ptx, name):
    # A contracted a*b+c rounds once instead of twice: float32 results would differ from the
    # CPU's. (float64 FMAs may appear in the metadata arithmetic, whose products are exact.)
    assert "fma.rn.f32" not in ptx[1][name]
    assert "mul.rn.f32" in ptx[1][name]
