"""maxbatch / scale --compile: compiled steps on the CPU relate the estimate to a compiled one."""

import json

from typer.testing import CliRunner

from actune.cli import app
from actune.tune.compiled import Calibration, compiled_answer, scaled
from actune.tune.search import Probe

CAL = Calibration(batches=(8, 64), estimate=(100, 1100), measured=(150, 650), fixed=50)


def test_the_calibration_line_passes_through_both_measured_points():
    assert CAL.ratio == 0.5
    assert CAL.predict(100, 50) == 150 and CAL.predict(1100, 50) == 650
    assert CAL.predict(2100, 50) == 1150
    # a deeper model's extra parameter state (100 bytes) counts once, not scaled
    assert CAL.predict(1200, 150) == 150 + 0.5 * (1200 - 100 - 100) + 100


def test_the_compiled_search_answers_on_the_scaled_peaks():
    def probe(n):  # an estimate: 50 fixed bytes, 20 per sample
        return Probe(n, 50 + 20 * n <= 1000, 50 + 20 * n, fixed=50)

    cal = Calibration((1, 2), (70, 90), (80, 90), 50)  # compiled: 10 per sample, 70 at 1
    assert [scaled(probe, cal, 1000)(n).peak for n in (1, 2, 10)] == [80, 90, 170]
    assert compiled_answer(probe, cal, 1000, start=1, step=1, maximum=None) == 93
    assert scaled(lambda n: Probe(n, False, None), cal, 1000)(4) == Probe(4, False, None)


MODEL = """
import torch
from torch import nn

def build_model(width=1.0):  # wide activations, few operations: small calibration batches
    c = int(32 * width)
    return nn.Sequential(nn.Conv2d(3, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU(),
                         nn.Conv2d(c, c, 3, padding=1), nn.GELU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, 10))

def make_batch(batch_size):
    return torch.randn(batch_size, 3, 32, 32), torch.randint(0, 10, (batch_size,))
"""


def test_maxbatch_compile_answers_for_a_compiled_step(tmp_path):
    model, out = tmp_path / "wide.py", tmp_path / "m.json"
    model.write_text(MODEL)
    result = CliRunner().invoke(app, ["maxbatch", str(model), "--levels", "L3", "--budget",
                                      "64MiB", "--compile", "--compile-backend", "aot_eager",
                                      "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "largest batch compiled: L3" in " ".join(result.output.split())
    for row in json.loads(out.read_text())["levels"]:
        low, high = row["compiled_batches"]
        assert low < high and 0.2 < row["compiled_ratio"] < 5
        assert row["compiled_value"] > 0
    wider = CliRunner().invoke(app, ["scale", str(model), "--dim", "width", "--batch", "32",
                                     "--levels", "L3", "--budget", "64MiB", "--compile",
                                     "--compile-backend", "aot_eager", "--json", str(out)])
    assert wider.exit_code == 0, wider.output
    row = json.loads(out.read_text())["levels"][0]
    assert row["compiled_batches"][0] == 8 and row["compiled_value"] > 0
    assert "largest width compiled: L3" in " ".join(wider.output.split())
    refused = CliRunner().invoke(app, ["maxbatch", "--compile", "--compile-backend", "nope"])
    assert refused.exit_code == 2 and "nope" in refused.output
