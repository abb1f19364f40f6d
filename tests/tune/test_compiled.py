"""maxbatch / scale --compile: compiled steps on the CPU relate the estimate to a compiled one."""

import json

from typer.testing import CliRunner

from actune.cli import app
from actune.tune.compiled import Calibration, Point, compiled_answer, scaled
from actune.tune.search import Probe

# what grows beyond the parameter state: the estimate 50 and 1,050 bytes, compiled 100 and 600
CAL = Calibration(Point(8, 50, 100), Point(64, 1050, 600))


def test_the_calibration_line_passes_through_both_measured_points():
    assert CAL.ratio == 0.5 and CAL.batches == (8, 64)
    assert CAL.predict(100, 50) == 150 and CAL.predict(1100, 50) == 650
    assert CAL.predict(2100, 50) == 1150
    # a deeper model's extra parameter state (100 bytes) counts once, not scaled
    assert CAL.predict(1200, 150) == 150 + 100 + 0.5 * (1200 - 150 - 50)


def _probe(n):  # an estimate: 50 bytes of parameter state, 20 a sample
    return Probe(n, 50 + 20 * n <= 1000, 50 + 20 * n, fixed=50)


LINE = Calibration(Point(1, 20, 30), Point(2, 40, 40))  # compiled: 70 + 10 a sample


def test_the_compiled_search_answers_on_the_line_and_checks_the_answer():
    assert [scaled(_probe, LINE, 1000)(n).peak for n in (1, 2, 10)] == [80, 90, 170]
    assert scaled(lambda n: Probe(n, False, None), LINE, 1000)(4) == Probe(4, False, None)
    true = compiled_answer(_probe, LINE, 1000, lambda n: Point(n, 20 * n, 20 + 10 * n),
                           start=1, step=1, maximum=None)
    assert (true.value, true.checked) == (93, True)
    # past the CPU's cap nothing is measured: the line's answer, said to be extrapolated
    far = compiled_answer(_probe, LINE, 1000, lambda n: None, start=1, step=1, maximum=None)
    assert (far.value, far.checked) == (93, False)


def test_an_answer_that_does_not_fit_corrects_the_line():
    """The compiled peak grows faster at large batches than between the calibration's
    (12 a sample there): the answer read off the first line does not fit, and the line
    through the largest measured points gives one that does."""
    def check(n):
        return Point(n, 20 * n, 20 + 12 * n)

    answer = compiled_answer(_probe, LINE, 1000, check, start=1, step=1, maximum=None)
    assert answer.checked and answer.value == 77 and answer.measured == (1, 2, 93, 77)
    assert 50 + check(77).measured <= 1000 < 50 + check(78).measured
    assert answer.calibration.batches == (2, 93)
    assert Calibration(Point(9, 40, 40), Point(3, 10, 20)).ratio == 2 / 3  # either order


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
                                      "24MiB", "--compile", "--compile-backend", "aot_eager",
                                      "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "largest batch compiled: L3" in " ".join(result.output.split())
    row = json.loads(out.read_text())["levels"][0]
    low, high = row["compiled_batches"][:2]
    assert low < high and 0.2 < row["compiled_ratio"] < 5
    assert row["compiled_value"] > 0 and row["compiled_checked"]
    refused = CliRunner().invoke(app, ["maxbatch", "--compile", "--compile-backend", "nope"])
    assert refused.exit_code == 2 and "nope" in refused.output


def test_scale_compile_reads_the_line_across_sizes(tmp_path, monkeypatch):
    """scale's compiled answer, with a stand-in compiled step holding 1.5 times what the
    estimate holds (the real one runs in the test above): the width whose estimate grows to
    the budget's room over 1.5."""
    from actune.tune import compiled
    from actune.tune.probe import Trial

    def standin(workload, config, sizes, batch, backend="inductor"):
        p = Trial(workload, config, sizes, "estimate", "cpu").peak(batch)
        fixed = p.parameters + p.gradients + p.optimizer
        return fixed + round(1.5 * (p.total - fixed))

    monkeypatch.setattr(compiled, "compiled_peak", standin)
    model, out = tmp_path / "wide.py", tmp_path / "s.json"
    model.write_text(MODEL)
    wider = CliRunner().invoke(app, ["scale", str(model), "--dim", "width", "--batch", "32",
                                     "--levels", "L0", "--budget", "64MiB", "--compile",
                                     "--json", str(out)])
    assert wider.exit_code == 0, wider.output
    row = json.loads(out.read_text())["levels"][0]
    assert row["compiled_batches"][:2] == [8, 32] and row["compiled_checked"]
    assert abs(row["compiled_ratio"] - 1.5) < 0.01
    assert 0 < row["compiled_value"] < row["value"]
    assert "largest width compiled: L0" in " ".join(wider.output.split())
