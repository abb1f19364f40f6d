"""The GPU check's scripts stay runnable without a GPU: the kernel comparison in numba-cuda's
simulator, the profiler on the CPU, and the driver script's syntax."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(args, **env):
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, **env))


def test_gpu_kernel_comparison_runs_in_the_simulator():
    done = _run(["scripts/gpu_kernels.py", "--numel", "300", "--no-speed", "--quick"],
                NUMBA_ENABLE_CUDASIM="1")
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    # float32 at a size with a tail group x 4 widths x 3 option sets, each compared byte for
    # byte (float64 and whole groups: tests/kernels/cudasim_cases.py)
    assert sum(line.endswith(": identical") for line in lines) == 12
    assert lines[-1] == "all identical"


def test_gpu_profile_runs_on_the_cpu():
    done = _run(["scripts/gpu_profile.py", "--device", "cpu", "--model", "tinycnn",
                 "--resolution", "8", "--batch", "8"])
    assert done.returncode == 0, done.stderr[-2000:]
    assert "L0: step" in done.stdout and "u2: step" in done.stdout
    assert "L3 compress(): step" in done.stdout
    assert "L3 compress(): synchronising calls in a statistics step and the next: 0" in done.stdout
    assert "pack" in done.stdout  # the busiest host functions include the packing


def test_gpu_memory_model_check_predicts_on_the_cpu(tmp_path):
    done = _run(["scripts/gpu_memory.py", "--device", "cpu", "--profile", "h200", "--cases",
                 "1", "--levels", "L0,L3", "--out", str(tmp_path)])
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [ln for ln in done.stdout.splitlines() if "predicted allocated" in ln]
    assert len(lines) == 2 and all("measured: no GPU here" in ln for ln in lines)


def test_gpu_compile_check_runs_the_compiled_pack_on_the_cpu():
    done = _run(["scripts/gpu_compile.py", "--device", "cpu", "--models", "none"])
    assert done.returncode == 0, done.stderr[-2000:]
    assert "compiled 2-bit pack of 65,536 float32" in done.stdout


def test_gpu_check_driver_parses():
    done = subprocess.run(["bash", "-n", str(ROOT / "scripts" / "gpu_check.sh")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_gpu_transformers_check_runs_on_the_cpu():
    done = _run(["scripts/gpu_transformers.py", "--device", "cpu", "--layers", "1",
                 "--batch", "1", "--steps", "1", "--seq", "64", "--tokens", "32"])
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    # math and flash, float32 and bfloat16, causal and masked: each compared
    assert sum("relative error" in line and "kept exact nothing" in line for line in lines) >= 6
    assert any(line.startswith("GPT-2 1 layers, batch 1 x 32, L3") for line in lines)


def test_no_script_shadows_an_installed_module():
    """A script's folder comes first on sys.path when it runs, so a script named like a module
    that a dependency imports replaces it (``benchmarks/kernels.py`` once hid Hugging Face's
    ``kernels``, which transformers imports, and every transformers benchmark failed)."""
    import importlib.util

    scripts = [p for folder in ("benchmarks", "scripts") for p in (ROOT / folder).glob("*.py")]
    assert len(scripts) > 10
    shadowing = []
    for path in scripts:
        loaded = sys.modules.get(path.stem)
        origin = (getattr(loaded, "__file__", None) if loaded is not None
                  else getattr(importlib.util.find_spec(path.stem), "origin", None))
        if origin is not None and Path(origin).parent != path.parent:
            shadowing.append(f"{path.relative_to(ROOT)} hides {origin}")
    assert not shadowing, shadowing


def test_op_coverage_runs_and_names_what_stays_exact():
    done = _run(["benchmarks/op_coverage.py", "--ops", "InstanceNorm2d,LSTM"])
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {line.split("│")[1].strip(): line for line in done.stdout.splitlines()
            if line.count("│") > 4}
    assert "nothing" in rows["InstanceNorm2d"] and "lstm" in rows["LSTM"]


def test_host_overhead_times_the_floor_with_the_kernels_stubbed_or_real():
    """The host-work benchmark's floor comparison runs, with the kernels no-ops (every
    layout's: a stubbed pack writes nothing, a stubbed unpack zeros) or real."""
    done = _run(["benchmarks/host_overhead.py", "--floor", "--rounds", "1", "--batch", "2",
                 "--real-kernels"])  # (the stubs: below, in this process)
    assert done.returncode == 0, done.stderr[-2000:]
    line = done.stdout.strip().splitlines()[-1]
    assert "both" in line and "L3" in line and "real kernels" in line
    # (in this process: every kernel module's attributes are put back after, each of them,
    # since the stubs would otherwise serve every later test of this worker)
    from actune_kernels import cpu, cpu_columns, cpu_rows

    modules = (cpu, cpu_rows, cpu_columns)
    kept = [dict(vars(module)) for module in modules]
    entry_points = [(cpu, "pack_at"), (cpu, "unpack_at"), (cpu_columns, "pack_columns_at"),
                    (cpu_columns, "unpack_columns_at")]
    originals = [getattr(module, name) for module, name in entry_points]
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import host_overhead

        host_overhead.no_op_kernels()
        stubbed = [getattr(module, name) for module, name in entry_points]
        # (an unpacked value comes back as zeros, not as whatever the buffer held: a NaN
        # there would make a compress()ed model's allocator collect at every step)
        import numpy as np

        out = np.full(12, np.nan, np.float32)
        cpu.unpack_at(0, 0, 2, 256, out.ctypes.data, 12, out.dtype)
        columns = np.full((2, 8), np.nan, np.float64)
        cpu_columns.unpack_columns_at(0, 0, 2, 64, columns.ctypes.data, 2, 8, columns.dtype)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
        for module, attributes in zip(modules, kept, strict=True):
            for name, value in attributes.items():
                if getattr(module, name, None) is not value:
                    setattr(module, name, value)
    assert all(a is not b for a, b in zip(stubbed, originals, strict=True))
    assert not out.any() and not columns.any()
    assert all(getattr(module, name) is kernel
               for (module, name), kernel in zip(entry_points, originals, strict=True))


def test_swin_digits_prints_a_curve_per_level_and_seed():
    done = _run(["benchmarks/swin_digits.py", "--levels", "L3", "--seeds", "0", "--epochs", "1"])
    assert done.returncode == 0, done.stderr[-2000:]
    assert "L3 seed 0: test accuracy by epoch" in done.stdout
    assert "L3: mean final accuracy" in done.stdout
