"""The parameter-state ceiling of depth and width searches."""

import json

from typer.testing import CliRunner

from actune.cli import app
from actune.tune.ceiling import parameter_bytes, parameter_state_ceiling
from actune.tune.workload import builtin


def test_the_ceiling_is_the_largest_size_whose_parameter_state_fits():
    workload = builtin("resnet18")
    budget = 600 * 2**20
    width = parameter_state_ceiling(workload, "width", 0.125, budget, per_byte=3.0)
    assert width is not None and width % 0.125 == 0
    assert 3 * parameter_bytes(workload, width=width) <= budget
    assert 3 * parameter_bytes(workload, width=width + 0.125) > budget
    assert parameter_state_ceiling(workload, "width", 0.125, 1000, 3.0) is None  # not even 1/8


def test_scale_reports_the_ceiling_above_every_level(tmp_path):
    out = tmp_path / "s.json"
    result = CliRunner().invoke(app, ["scale", "--dim", "width", "--model", "resnet18",
                                      "--batch", "8", "--budget", "1GiB", "--levels", "L0,L3",
                                      "--json", str(out)], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["ceiling"] >= max(r["value"] for r in data["levels"])
    assert f"parameter-state ceiling: width {data['ceiling']:g}x" in result.output
