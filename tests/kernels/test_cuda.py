"""The CUDA kernels: same bytes as the reference in numba-cuda's simulator (own process, small
tensors), and they compile to PTX for sm_90 without a GPU."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from actune_kernels import cuda as kernels


def test_cuda_kernels_match_reference_in_simulator():
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    script = Path(__file__).with_name("cudasim_cases.py")
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 8 and all(line.endswith("same=True") for line in lines)


@pytest.fixture(scope="module")
def ptx():
    return kernels.compile_ptx((9, 0))


@pytest.mark.parametrize("name", ["pack", "unpack"])
def test_kernels_compile_to_ptx_for_sm90(ptx, name):
    assert ".target sm_90" in ptx[name]
    assert ".entry" in ptx[name]


@pytest.mark.parametrize("name", ["pack", "unpack"])
def test_no_fused_multiply_add_so_bytes_match_the_cpu(ptx, name):
    # A contracted a*b+c rounds once instead of twice: float32 results would differ from the
    # CPU's. (float64 FMAs may appear in the metadata arithmetic, whose products are exact.)
    assert "fma.rn.f32" not in ptx[name]
    assert "mul.rn.f32" in ptx[name]
