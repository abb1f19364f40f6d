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
def test_avx2_code_matches_reference():
    here = Path(__file__).parent
    probe = ("from actune_kernels import isa; "
             "assert isa.vector_width() == 'AVX2', isa.vector_width()")
    env = {**os.environ, **isa.codegen_env("avx2")}  # numba caches per target
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    subprocess.run([sys.executable, "-c", probe], env=env, check=True)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         str(here / "test_cpu_matches_reference.py"), "-k", "bytes_match or other_group"],
        env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert " passed" in done.stdout and " failed" not in done.stdout
