"""The command line, end to end on small built-in models (estimate mode: no GPU here)."""

import json
import statistics

import pytest
from typer.testing import CliRunner

from actune.apps import zoo
from actune.cli import app
from actune.tune.report import CPU_MEASURE_CAVEAT, ESTIMATE_CAVEAT

runner = CliRunner()


def run(*args):
    return runner.invoke(app, list(args))


def flat(text: str) -> str:
    """``text`` without whitespace or the box rich draws around errors (which wraps lines)."""
    return "".join(c for c in text if not c.isspace() and c not in "│╭╮╰╯─")


def test_version_is_one_number_everywhere():
    from importlib.metadata import version

    import actune

    result = run("--version")
    assert result.exit_code == 0 and result.output.strip() == f"actune {actune.__version__}"
    assert version("actune") == actune.__version__  # the package metadata reads the same
    assert actune.__version__ in run("info").output


def test_info_says_plainly_when_there_is_no_gpu():
    result = run("info")
    assert result.exit_code == 0, result.output
    assert "GPU" in result.output and "default budget" in result.output


def test_maxbatch_writes_versioned_json_and_compression_gains(tmp_path):
    out = tmp_path / "r" / "maxbatch.json"
    result = run("maxbatch", "--model", "resnet18", "--resolution", "32", "--levels", "L0,L3",
                 "--budget", "256MiB", "--json", str(out), "--multiple-of", "4")
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["schema"] == "actune.result/2" and data["command"] == "maxbatch"
    l0, l3 = data["levels"]
    assert (l0["level"], l3["level"]) == ("L0", "L3")
    assert l0["value"] % 4 == 0 and l3["value"] % 4 == 0
    assert l3["value"] > 1.5 * l0["value"]  # small images: the forward pass dominates
    assert l3["peak_bytes"] <= 256 * 2**20 and l3["compression"] > 10
    parts = l3["peak_parts"]
    assert set(parts) == {"parameters", "gradients", "optimizer", "activations", "temporaries",
                          "other"}
    assert sum(parts.values()) == l3["peak_bytes"]
    assert l3["probes"] and all({"size", "fits", "peak"} <= p.keys() for p in l3["probes"])
    assert "max batch" in result.output and "L3" in result.output
    # where each level peaks: the phase and a module of the model, in the JSON and the table
    modules = {name: m for name, m in zoo.resnet(18).named_modules() if name}
    for level in (l0, l3):
        phase, _, place = level["peak_at"].partition(", ")
        module, _, kind = place.partition(" ")  # "layer1.0.bn1 (BatchNorm2d)"
        assert phase in ("forward", "backward") and module in modules, level["peak_at"]
        assert kind == f"({type(modules[module]).__name__})", level["peak_at"]
    assert "peak at: L0 " in " ".join(result.output.split())
    assert flat(ESTIMATE_CAVEAT) in flat(result.output)  # what an estimate leaves out


def test_measured_on_the_cpu_says_it_counts_tensors_only():
    result = run("maxbatch", "--model", "tinycnn", "--levels", "L0", "--budget", "32MiB",
                 "--mode", "measure")
    assert result.exit_code == 0, result.output
    assert flat(CPU_MEASURE_CAVEAT) in flat(result.output)
    assert flat(ESTIMATE_CAVEAT) not in flat(result.output)


def test_max_caps_the_search(tmp_path):
    result = run("maxbatch", "--model", "tinycnn", "--levels", "L3", "--budget", "1GiB",
                 "--max", "64", "--quiet", "--json", str(tmp_path / "capped.json"))
    assert result.exit_code == 0, result.output
    assert result.output.strip() == ""


def test_scale_depth_and_the_error_for_a_missing_dimension(tmp_path):
    out = tmp_path / "scale.json"
    result = run("scale", "--model", "resnet18", "--dim", "width", "--batch", "8",
                 "--levels", "L0,L3", "--budget", "256MiB", "--json", str(out), "--max", "4")
    assert result.exit_code == 0, result.output
    levels = json.loads(out.read_text())["levels"]
    assert levels[1]["value"] >= levels[0]["value"] > 0
    assert {p["size"] for p in levels[0]["probes"]} != {8}  # widths tried, not the batch
    assert max(p["size"] for p in levels[0]["probes"] if p["fits"]) == levels[0]["value"]
    for level in levels:  # printed in full (a multiple of 1/8: 2.125x, not 2.12x)
        assert f"{level['value']:g}x" in result.output
    bad = run("scale", "--model", "tinycnn", "--dim", "depth")
    assert bad.exit_code == 2
    assert "cannot be scaled in depth" in bad.output and "Traceback" not in bad.output


def test_a_speed_ratio_lies_inside_its_own_spread():
    """Rounds where the ratio of the median times (0.67) falls outside the per-round ratios'
    middle half (0.75-1.0): the figure shown is their median (1.0), inside it."""
    from actune.tune.bench import _round_ratios

    base, times = [3.0, 1.0, 4.0, 2.0, 2.0], [4.0, 1.0, 4.0, 3.0, 2.0]
    assert statistics.median(base) / statistics.median(times) == pytest.approx(2 / 3)
    assert _round_ratios(base, times) == (0.75, 1.0, 1.0)
    assert _round_ratios([1.0, 2.0], [2.0, 2.0]) == (0.5, 0.75, 1.0)  # two rounds: both ends


def test_bench_runs_real_steps_and_relates_to_l0(tmp_path):
    out = tmp_path / "bench.json"
    result = run("bench", "--model", "tinycnn", "--resolution", "8", "--batch", "32",
                 "--levels", "L0,L3", "--steps", "2", "--warmup", "1", "--json", str(out))
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    levels = data["levels"]
    assert levels[0]["ratio"] == 1.0 and levels[1]["samples_per_s"] > 0
    assert "samples/s" in result.output
    # the run's own spread beside the ratios: the median of the per-round ratios within the
    # middle half of them (two rounds: their two ends)
    lo, hi = levels[1]["ratio_spread"]
    assert 0 < lo <= levels[1]["ratio"] <= hi and levels[0]["ratio_spread"] is None
    assert levels[1]["ratio"] == levels[1]["round_ratio"]
    assert f"vs L0, the middle half of the rounds: L3 {lo:.2f}-{hi:.2f}x" in result.output
    # it ends with what a user came for: the largest batch at L0 and at L3, estimated
    answer = data["answer"]
    assert 0 < answer["L0"] < answer["L3"] and answer["seconds"] > 0
    lines = result.output.strip().splitlines()
    line = f"largest batch under 16.0 GiB: L0 {answer['L0']:,}, L3 {answer['L3']:,} ("
    found = [i for i, text in enumerate(lines) if text.startswith(line)]
    assert found and all(not text.startswith(("peak at", "estimate:")) for text in
                         lines[found[0]:])  # after the table's notes


@pytest.mark.parametrize(("args", "message"), [
    (("maxbatch", "--levels", "L9"), "valid levels: L0, L1, L2, L3, L4, L5"),
    (("maxbatch", "missing_model.py"), "does not exist"),
    (("maxbatch", "--budget", "lots"), "is not a size"),
    (("maxbatch", "--model", "vgg"), "no built-in model"),
    (("maxbatch", "--mode", "guess"), "--mode must be estimate or measure"),
    (("maxbatch", "--model", "tinycnn", "--resolution", "0"), "Invalid value for '--resolution'"),
    (("maxbatch", "--model", "tinycnn", "--multiple-of", "8", "--max", "5"),
     "--max 5 is below the step 8"),  # the value given, not its rounding (0)
    (("scale", "--dim", "width", "--model", "tinycnn", "--max", "0.05"),
     "--max 0.05 is below the smallest width step (0.125x)"),
])
def test_bad_input_exits_2_with_a_message_and_no_traceback(args, message):
    result = run(*args)
    assert result.exit_code == 2
    assert message in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize("option", ["--json", "--plot"])
def test_an_output_path_that_cannot_be_written_is_refused_before_any_work(tmp_path, monkeypatch,
                                                                         option):
    from actune.tune import bench as tune_bench

    def no_work(*args, **kwargs):
        raise AssertionError("the job ran")

    monkeypatch.setattr(tune_bench, "bench", no_work)
    a_file = tmp_path / "notes.txt"
    a_file.write_text("kept")
    for path, message in ((tmp_path, "is a folder; give a file in it"),
                          (a_file / "out.json", "is a file, so")):
        result = run("bench", "--model", "tinycnn", "--levels", "L0", option, str(path))
        assert result.exit_code == 2, result.output
        assert flat(message) in flat(result.output) and "Traceback" not in result.output
    assert a_file.read_text() == "kept"


def test_a_json_write_that_fails_midway_is_an_error_not_a_traceback(tmp_path, monkeypatch):
    from actune.tune import report

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(report, "write_json", full_disk)
    result = run("maxbatch", "--model", "tinycnn", "--levels", "L0", "--budget", "64MiB",
                 "--json", str(tmp_path / "r.json"))
    assert result.exit_code == 2
    assert flat("cannot write --json") in flat(result.output)
    assert flat("No space left on device") in flat(result.output)
    assert "Traceback" not in result.output


def test_debug_shows_the_traceback():
    result = run("maxbatch", "missing_model.py", "--debug")
    assert result.exit_code != 0
    assert result.exception is not None


def test_json_of_finished_levels_survives_an_interrupt(tmp_path, monkeypatch):
    from actune.tune import run as tune_run

    out = tmp_path / "partial.json"
    real = tune_run.Trial.probe
    calls = {"n": 0}

    def flaky(self, batch, budget):
        if self.config.name == "L3":
            raise KeyboardInterrupt
        calls["n"] += 1
        return real(self, batch, budget)

    monkeypatch.setattr(tune_run.Trial, "probe", flaky)
    result = run("maxbatch", "--model", "tinycnn", "--levels", "L0,L3", "--budget", "64MiB",
                 "--json", str(out))
    assert result.exit_code == 130
    l0, l3 = json.loads(out.read_text())["levels"]
    assert "interrupted" in result.output and f"{l0['value']:,}" in result.output  # printed
    assert l0["complete"] and l0["value"]
    assert not l3["complete"] and l3["value"] is None  # marked, not passed off as a result


def test_an_interrupt_before_any_level_finished_says_nothing_was_kept(tmp_path, monkeypatch):
    from actune.tune import bench as tune_bench

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(tune_bench, "throughputs", interrupted)  # bench times levels together
    out = tmp_path / "bench.json"
    result = run("bench", "--model", "tinycnn", "--levels", "L0,L3", "--batch", "8",
                 "--json", str(out))
    assert result.exit_code == 130
    assert "nothing was kept" in result.output and "were kept" not in result.output
    assert not out.exists()


def test_summary_lists_what_compress_converts():
    result = run("summary", "--model", "tinycnn")
    assert result.exit_code == 0, result.output
    assert "Conv2d" in result.output and "never substituted" not in result.output
    assert "layers converted" in result.output


def test_bench_plot_draws_a_png(tmp_path):
    png = tmp_path / "speed.png"
    result = run("bench", "--model", "tinycnn", "--resolution", "8", "--batch", "16",
                 "--levels", "L0,L3", "--steps", "1", "--warmup", "0", "--plot", str(png))
    assert result.exit_code == 0, result.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_train_side_by_side_with_the_allocation_and_json(tmp_path):
    out = tmp_path / "train.json"
    result = run("train", "--levels", "L0,1.25b", "--epochs", "2", "--every", "5",
                 "--json", str(out))
    assert result.exit_code == 0, result.output
    assert "L0" in result.output and "1.25b" in result.output
    assert "bits per compressed tensor" in result.output  # the allocator's table
    data = json.loads(out.read_text())
    assert data["schema"] == "actune.apps.train/1"
    rows = data["levels"]["1.25b"]["epochs"]
    assert [r["epoch"] for r in rows] == [1, 2]
    assert rows[-1]["loss"] < rows[0]["loss"] and rows[-1]["test_accuracy"] > 0.8
    assert rows[-1]["mean_bits"] <= 1.25 + 1e-9
    allocation = data["levels"]["1.25b"]["allocation"]
    assert allocation["slots"] and allocation["per_sample"]
    # samples are named by default: every training sample was seen and remembered
    assert allocation["samples_remembered"] == 1433 and "sensitivity" not in allocation
    assert data["levels"]["L0"]["allocation"] is None


def test_train_compile_adds_a_compiled_column_that_learns_like_the_eager_one(tmp_path):
    out = tmp_path / "train.json"
    result = run("train", "--levels", "L3", "--epochs", "1", "--compile", "--compile-backend",
                 "aot_eager", "--json", str(out))  # (Inductor's own: tests/traced/)
    assert result.exit_code == 0, result.output
    assert "L3 compiled" in result.output and "UserWarning" not in result.output
    levels = json.loads(out.read_text())["levels"]
    eager, compiled = levels["L3"]["epochs"][-1], levels["L3 compiled"]["epochs"][-1]
    assert compiled["level"] == "L3 compiled" and compiled["test_accuracy"] > 0.85
    assert abs(compiled["loss"] - eager["loss"]) < 0.1 * eager["loss"]


def test_an_unknown_compile_backend_names_the_known_ones():
    result = run("train", "--levels", "L3", "--compile", "--compile-backend", "nope")
    assert result.exit_code == 2 and "inductor" in result.output


def test_train_from_a_model_file_with_its_own_dataset(tmp_path):
    f = tmp_path / "blobs.py"
    f.write_text(
        "import torch\n"
        "from torch import nn\n"
        "def build_model():\n"
        "    return nn.Sequential(nn.Linear(256, 64), nn.ReLU(), nn.Linear(64, 3))\n"
        "def make_batch(n):\n"
        "    return torch.randn(n, 256), torch.randint(0, 3, (n,))\n"
        "def make_dataset():\n"
        "    g = torch.Generator().manual_seed(0)\n"
        "    y = torch.randint(0, 3, (300,), generator=g)\n"
        "    x = torch.randn(300, 256, generator=g) + 2 * nn.functional.one_hot(y, 256)\n"
        "    return x[:240], y[:240], x[240:], y[240:]\n")
    result = run("train", str(f), "--levels", "L0,L3", "--epochs", "2")
    assert result.exit_code == 0, result.output
    assert "240 training / 60 test" in " ".join(result.output.split())


@pytest.mark.parametrize(("args", "message"), [
    (("train", "--model", "transformer"), "has no dataset"),
    (("train", "--levels", "L3,9b"), "within [1, 8]"),
    (("numerics", "--levels", "L0"), "compressing level"),
    (("train", "--device", "tpu"), "--device tpu: use cpu"),
])
def test_train_and_numerics_bad_input(args, message):
    result = run(*args)
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split())
    assert "Traceback" not in result.output


def test_numerics_reports_bias_and_both_variances(tmp_path):
    out = tmp_path / "n.json"
    result = run("numerics", "--levels", "u2,L3", "--repeats", "4", "--draws", "4",
                 "--no-layers", "--json", str(out))
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["schema"] == "actune.apps.numerics/1"
    uniform, mixed = data["levels"]
    assert (uniform["level"], mixed["level"]) == ("u2", "L3")
    for r in (uniform, mixed):
        assert 0 < r["quant_variance"] < r["sgd_variance"]  # rounding is the smaller noise
        assert r["layers"] and sum(x["numel"] for x in r["layers"]) == 29162
    assert mixed["mean_bits"] == pytest.approx(2.0, abs=1e-6)


def test_help_names_no_type_for_flags_and_keeps_summaries_on_their_lines():
    top = runner.invoke(app, ["--help"], env={"COLUMNS": "140"})
    assert top.exit_code == 0 and "<bool>" not in top.output
    lines = top.output.splitlines()
    for command in ("train", "numerics", "summary"):  # the summary line only, not cut
        line = next(i for i, text in enumerate(lines) if text.startswith(f"│ {command} "))
        assert lines[line].rstrip(" │").endswith("."), lines[line]
        assert lines[line + 1][2] != " ", lines[line + 1]  # the next command: nothing wrapped
    sub = runner.invoke(app, ["maxbatch", "--help"], env={"COLUMNS": "100"})
    assert "<bool>" not in sub.output and "<str>" in sub.output  # values keep their type


def test_tables_fit_80_columns_with_the_notes_under_them():
    result = runner.invoke(app, ["maxbatch", "--model", "tinycnn", "--budget", "2GiB",
                                 "--levels", "L0,L4", "--max", "64"], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert max(map(len, lines)) <= 80
    rows = [line for line in lines if line.split()[:1] in (["L0"], ["L4"])]
    assert len(rows) == 2  # one line a level: no cell wraps
    assert "L0, L4: capped by --max" in result.output or "L4: offload simulated" in result.output
    assert result.output.index("L4: offload simulated") > result.output.index(rows[-1])


def test_bench_at_max_names_the_fastest_configuration_that_fits(tmp_path):
    out = tmp_path / "b.json"
    result = run("bench", "--model", "tinycnn", "--budget", "32MiB", "--levels", "L0,L3",
                 "--at-max", "--steps", "1", "--warmup", "1", "--json", str(out))
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    rows = {r["level"]: r for r in data["levels"]}
    best = data["best"]
    assert best["level"] in rows and best["batch"] == rows[best["level"]]["value"]
    assert best["samples_per_s"] == max(r["samples_per_s"] for r in rows.values())
    assert f"fastest within the budget: {best['level']} at batch {best['batch']:,}" in \
        " ".join(result.output.split())


def test_progress_shows_the_trial_its_size_and_the_time_left():
    from actune.cli import tuning as cli
    from actune.tune.alternatives import get_config
    from actune.tune.report import LevelResult, Report
    from actune.tune.search import Probe

    progress = cli._progress(False)  # not started: its tasks are what it would show
    on_probe, on_level = cli._callbacks(progress, ["L0", "L3"], None, cli._Latest())
    on_probe(get_config("L0"), Probe(8, True, 2**20))
    on_probe(get_config("L0"), Probe(16, False, 2**21))
    task = progress.tasks[0]
    assert task.description == "L0: trial 2, size 16 does not fit, peak 2.0 MiB"
    assert task.completed == 2 and task.total == 2 * cli.TRIALS_PER_LEVEL
    on_probe(get_config("L3"), Probe(8, True, 2**20))  # searched side by side with L0
    assert progress.tasks[0].description.startswith("L3: trial 1, size 8")
    assert task.completed == 3
    report = Report("maxbatch", "m", "CPU", 1, "test", "estimate", "batch")
    report.levels.append(LevelResult("L0"))
    on_level(report)
    assert task.fields["done"] == 1 and task.completed == cli.TRIALS_PER_LEVEL + 1
    on_probe(get_config("L3"), Probe(16, True, 2**20))
    assert progress.tasks[0].description.startswith("L3: trial 2, size 16")
    assert task.completed == cli.TRIALS_PER_LEVEL + 2
    names = [type(c).__name__ for c in progress.columns]
    assert "TimeRemainingColumn" in names


def test_an_estimate_of_l5_reuses_l4s_search(tmp_path):
    out = tmp_path / "r.json"
    result = run("maxbatch", "--model", "tinycnn", "--budget", "64MiB", "--levels", "L4,L5",
                 "--json", str(out))
    assert result.exit_code == 0, result.output
    l4, l5 = json.loads(out.read_text())["levels"]
    assert l5["value"] == l4["value"] and l5["peak_bytes"] == l4["peak_bytes"]
    assert l4["probes"] and l5["probes"] == [] and "estimated as L4" in l5["note"]
    assert f"{len(l4['probes'])} probes in" in result.output


_SIZED_FILE = '''
from pathlib import Path
import torch
from torch import nn

def build_model(resolution: int = 6):
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * resolution * resolution, 2))

def make_batch(batch_size, resolution=6):
    Path(__file__).with_suffix(".seen").write_text(str(resolution))
    return torch.randn(batch_size, 3, resolution, resolution), torch.randint(0, 2, (batch_size,))
'''


def test_bench_keeps_a_model_files_own_resolution_unless_one_is_given(tmp_path):
    """bench's quick default (32) is for the built-in models; a model file's sizes are the
    user's and stay as written unless --resolution says otherwise."""
    path = tmp_path / "sized.py"
    path.write_text(_SIZED_FILE)
    seen = path.with_suffix(".seen")
    common = ("--levels", "L0", "--batch", "4", "--steps", "1", "--warmup", "0", "--quiet")
    result = run("bench", str(path), *common)
    assert result.exit_code == 0, result.output
    assert seen.read_text() == "6"
    result = run("bench", str(path), "--resolution", "4", *common)
    assert result.exit_code == 0, result.output
    assert seen.read_text() == "4"


def test_maxbatch_plot_draws_each_level_up_to_its_own_max_batch(tmp_path, monkeypatch):
    from actune.tune import bench as tune_bench

    timed = []

    def throughput(workload, level, batch, sizes, device, steps=5, warmup=2):
        timed.append((level.name, batch))
        return 100.0 + batch

    monkeypatch.setattr(tune_bench, "throughput", throughput)
    png, out = tmp_path / "curves.png", tmp_path / "r.json"
    result = run("maxbatch", "--model", "tinycnn", "--budget", "64MiB", "--levels", "L0,L3",
                 "--plot", str(png), "--json", str(out))
    assert result.exit_code == 0, result.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    best = {row["level"]: row["value"] for row in json.loads(out.read_text())["levels"]}
    assert best["L3"] > best["L0"]
    for level, top in best.items():  # four points halving from the level's own max batch
        assert sorted(b for name, b in timed if name == level) == \
            sorted({max(1, top >> k) for k in range(4)})
    assert "plot written to" in result.output
