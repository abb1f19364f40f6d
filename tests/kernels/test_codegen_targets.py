"""The CPU kernels give the reference's bytes whatever vector instructions they are compiled
for: the byte-identity cases run again in a process compiled for AVX2 (no AVX-512)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from actune_kernels import isa


def test_codegen_env_turns_off_avx512_only():
    env = isa.codegen_env("avx2")
    assert isa.codegen_env("native") == {}
    assert env["NUMBA_CPU_NAME"] == "haswell"
    features = env["NUMBA_CPU_FEATURES"].split(",")
    assert not [f for f in features if f.startswith("+avx512")]
    assert ("+avx2" in features) == isa.has("avx2")


@pytest.mark.skipif(not isa.has("avx2"), reason="the host CPU has no AVX2 to compile for")
@pytest.mark.skipif(isa.has("avx2") and not isa.has("avx512f"),
                    reason="the host's own code is AVX2 code: the suite's reference tests "
                           "check it (compiling it again for another CPU name takes a minute)")
def test_avx2_code_matches_reference():
    here = Path(__file__).parent
    probe = ("from actune_kernels import isa; "
             "assert isa.vector_width() == 'AVX2', isa.vector_width()")
    env = {**os.environ, **isa.codegen_env("avx2")}  # numba caches per target
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    subprocess.run([sys.executable, "-c", probe], env=env, check=True)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0",
         str(here / "test_cpu_matches_reference.py"), "-k", "bytes_match or other_group"],
        env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert " passed" in done.stdout and " failed" not in done.stdout


_ASM_PROBE = """
import numpy as np
from actune_kernels import cpu_groups
x = np.linspace(-1, 1, 4096, dtype=np.float32)
codes, meta = np.zeros(1024, np.uint8), np.zeros((16, 2), np.uint16)
_, magnitude, inf_key = cpu_groups._BITS[x.dtype]
# the 2-bit run alone, called as the kernels call it (compiling every width would take longer)
cpu_groups._G2(x, x.view(np.int32), 0, 16, 0, 256, codes, 0, meta, magnitude, inf_key, 1, 0,
               True, True)
for sig, asm in cpu_groups._G2.inspect_asm().items():  # min/max and codes loops inlined in it
    if "float32" in str(sig):
        low = asm.lower()
        print("run", "gathers", low.count("gather"), "minsd", low.count("vpminsd"),
              "minsq", low.count("vpminsq"), "mulld", low.count("vpmulld"))
"""


@pytest.mark.skipif(not isa.has("avx2"), reason="the host CPU has no AVX2 to compile for")
@pytest.mark.parametrize("target", ["native", "avx2"])
def test_pack_loops_load_contiguously_in_32_bit_lanes(tmp_path, target):
    """The pack kernel's loops vectorize as written: contiguous loads (no gathers, which
    Numba's negative-index wrap-around used to force), float32 keys and the random stream in
    32-bit lanes (vector 32-bit min and multiply, no 64-bit min)."""
    env = {**os.environ, **isa.codegen_env(target), "NUMBA_CACHE_DIR": str(tmp_path)}
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    done = subprocess.run([sys.executable, "-c", _ASM_PROBE], env=env, capture_output=True,
                          text=True, timeout=600, check=True)
    rows = {line.split()[0]: [int(v) for v in line.split()[2::2]]
            for line in done.stdout.splitlines() if line.strip()}
    assert set(rows) == {"run"}, done.stdout + done.stderr[-2000:]
    gathers, min32, min64, mul32 = rows["run"]
    assert gathers == 0 and min64 == 0, done.stdout
    assert min32 > 0 and mul32 > 0, done.stdout  # the min/max keys and the random stream


_PARALLEL_PROBE = """
import sys
import numpy as np
from actune_kernels import cpu
n = int(sys.argv[1])
codes, meta = np.zeros(n // 4 + 256, np.uint8), np.zeros((n // 256 + 1, 2), np.uint16)
cpu.unpack(codes, meta, 2, 256, np.empty(n, np.float32))
for kernel in (cpu._unpack, cpu._unpack_serial):
    for sig in kernel.signatures:
        print(kernel.py_func.__qualname__, "do_scheduling" in kernel.inspect_llvm(sig))
"""


def test_the_pool_kernel_stays_parallel_when_the_serial_one_was_cached_first(tmp_path):
    """The one-thread copy of a kernel is cached under its own name: a process that unpacks a
    large tensor after another cached the small-tensor kernel still runs on the pool. (The
    unpack kernels compile in a fraction of the pack kernels' time; ``cpu._serial`` makes the
    one-thread copies of both.)"""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    env.pop("NUMBA_ENABLE_CUDASIM", None)

    def run(n: int) -> str:
        return subprocess.run([sys.executable, "-c", _PARALLEL_PROBE, str(n)], env=env,
                              capture_output=True, text=True, timeout=600, check=True).stdout

    assert run(1000).split() == ["_unpack_serial", "False"]
    assert run(100_000).split() == ["_unpack", "True"]
