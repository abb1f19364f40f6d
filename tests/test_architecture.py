"""The import contracts of docs/architecture.md hold, and they catch what they are for: a copy
of the packages with an upward import, a circle or torch in the kernels fails them."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT = [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command;"
        " sys.exit(lint_imports_command())"]


def _lint(where: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(where)}
    return subprocess.run(LINT, cwd=where, env=env, capture_output=True, text=True, timeout=120)


def test_the_packages_keep_their_layers_and_have_no_circle():
    run = _lint(ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "BROKEN" not in run.stdout and run.stdout.count("KEPT") == 4


@pytest.mark.parametrize(("module", "line", "broken"), [
    ("actune/packing/saved.py", "from actune.session import hooks", "actune's layers"),
    ("actune/packing/kernels.py", "from actune.packing import tensors",
     "no import circle inside any package"),
    ("actune/tune/bench.py", "from actune.session import hooks",
     "the tuner and the command line use the library through its public API"),
    ("actune_kernels/layout.py", "import torch", "the kernels know nothing of torch"),
])
def test_a_broken_contract_fails_the_check(tmp_path, module, line, broken):
    for part in ("actune", "actune_kernels"):
        shutil.copytree(ROOT / part, tmp_path / part,
                        ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    with open(tmp_path / module, "a") as f:
        f.write(f"\n{line}  # noqa\n")
    run = _lint(tmp_path)
    assert run.returncode != 0
    assert f"{broken}" in run.stdout and "BROKEN" in run.stdout
