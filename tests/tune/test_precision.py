"""`--precision` (Lightning's names): estimates and real steps run as that precision runs."""

from __future__ import annotations

import json

import torch
from typer.testing import CliRunner

from actune.cli import app
from actune.tune.workload import builtin, load

runner = CliRunner()


def _maxbatch(tmp_path, *extra):
    out = tmp_path / "r.json"
    result = runner.invoke(app, ["maxbatch", "--model", "tinycnn", "--levels", "L0,L3",
                                 "--budget", "64MiB", "--json", str(out), *extra])
    assert result.exit_code == 0, result.output
    return json.loads(out.read_text()), result.output


def test_bf16_mixed_halves_what_l0_saves_and_ratios_are_against_it(tmp_path):
    full, _ = _maxbatch(tmp_path)
    half, text = _maxbatch(tmp_path, "--precision", "bf16-mixed")
    assert full["precision"] == "32-true" and half["precision"] == "bf16-mixed"
    assert "bf16-mixed" in text.splitlines()[1]  # the title says which
    l0_full, l0_half = full["levels"][0], half["levels"][0]
    per_sample_full = l0_full["activation_bytes"] / l0_full["value"]
    per_sample_half = l0_half["activation_bytes"] / l0_half["value"]
    assert 0.4 < per_sample_half / per_sample_full < 0.75
    # L3 against bf16's own L0: a smaller ratio than against float32's
    assert half["levels"][1]["compression"] < full["levels"][1]["compression"]


def test_bf16_true_builds_the_model_in_bfloat16_and_casts_the_batch():
    work = builtin("tinycnn")
    work.precision = "bf16-true"
    model = work.model()
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    x, y = work.make_batch(4)
    assert x.dtype == torch.bfloat16 and not y.is_floating_point()
    assert work.step_loss(model, x, y).dtype == torch.bfloat16


def test_a_model_file_sets_its_precision(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("import torch\nprecision = 'bf16-mixed'\n"
                    "def build_model():\n    return torch.nn.Linear(4, 2)\n"
                    "def make_batch(n):\n    return torch.randn(n, 4), torch.randint(0, 2, (n,))\n")
    assert load(path).precision == "bf16-mixed"
    path.write_text(path.read_text().replace("bf16-mixed", "fp8"))
    result = runner.invoke(app, ["summary", str(path)])
    assert result.exit_code == 2 and "not one of" in result.output


def test_an_unknown_precision_is_refused():
    result = runner.invoke(app, ["maxbatch", "--precision", "fp8"])
    assert result.exit_code == 2 and "32-true, bf16-mixed, 16-mixed, bf16-true" in result.output


def test_16_mixed_real_steps_run_with_a_grad_scaler(tmp_path):
    result = runner.invoke(app, ["bench", "--model", "tinycnn", "--levels", "L0,L3",
                                 "--precision", "16-mixed", "--steps", "1", "--warmup", "0",
                                 "--batch", "8", "--json", str(tmp_path / "b.json")])
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "b.json").read_text())
    assert report["precision"] == "16-mixed"
    assert all(r["samples_per_s"] > 0 for r in report["levels"])


def test_train_at_bf16_true():
    result = runner.invoke(app, ["train", "--model", "tinycnn", "--levels", "L3",
                                 "--precision", "bf16-true", "--epochs", "1"])
    assert result.exit_code == 0, result.output
