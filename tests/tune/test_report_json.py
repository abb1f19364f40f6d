"""Writing results: atomic for files, in place for devices and pipes, nothing else touched."""

import json
import os
import stat
import threading

from actune.tune.report import write_json


def test_a_new_file_gets_the_usual_permissions_and_a_replaced_one_keeps_its_own(tmp_path):
    mask = os.umask(0o022)
    try:
        new = tmp_path / "sub" / "new.json"
        write_json({"a": 1}, new)
        assert json.loads(new.read_text()) == {"a": 1}
        assert stat.S_IMODE(new.stat().st_mode) == 0o644  # not a temporary file's 0o600
        new.chmod(0o640)
        write_json({"a": 2}, new)
        assert json.loads(new.read_text()) == {"a": 2}
        assert stat.S_IMODE(new.stat().st_mode) == 0o640
    finally:
        os.umask(mask)
    assert sorted(p.name for p in new.parent.iterdir()) == ["new.json"]  # no temporary left


def test_a_symbolic_link_stays_and_its_target_is_written(tmp_path):
    target = tmp_path / "results" / "run.json"
    target.parent.mkdir()
    target.write_text("{}")
    link = tmp_path / "latest.json"
    link.symlink_to(target)
    write_json({"b": 3}, link)
    assert link.is_symlink() and json.loads(target.read_text()) == {"b": 3}


def test_a_pipe_is_written_in_place_not_replaced(tmp_path):
    # as /dev/null or /dev/stdout would be: a rename over it would replace the device itself
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()))
    reader.start()
    write_json({"c": 4}, fifo)
    reader.join(timeout=10)
    assert stat.S_ISFIFO(fifo.stat().st_mode)
    assert json.loads(got[0]) == {"c": 4}


def test_what_stays_exact_is_named_under_the_table():
    from rich.console import Console

    from actune.tune.report import LevelResult, Report, render

    report = Report("maxbatch", "m", "CPU", 2**30, "given", "estimate", "batch")
    report.levels = [LevelResult("L0", 8), LevelResult("L3", 64, kept_exact={
        "cross_entropy": 80 * 2**20, "(saved outside any op)": 3 * 2**20, "small tensors": 5})]
    console = Console(record=True, width=200)
    render(report, console)
    text = " ".join(console.export_text().split())  # (the caption wraps at the table's width)
    assert "L3 kept exact: 83.0 MiB (cross_entropy 80.0 MiB, (saved outside any op) 3.0 MiB, " \
           "small tensors 5 B)" in text
    assert "L0 kept exact" not in text


def test_error_messages_with_brackets_print_as_written(tmp_path):
    from typer.testing import CliRunner

    from actune.cli import app

    path = tmp_path / "needs_hf.py"
    path.write_text("raise ImportError(\"needs transformers: pip install 'actune[hf]'\")\n")
    result = CliRunner().invoke(app, ["maxbatch", str(path)])
    assert result.exit_code == 2
    assert "pip install 'actune[hf]'" in result.output


def test_the_default_bench_title_fits_80_columns_on_one_line():
    """The title is printed above the table, not as its title (which wraps to the table's
    width), and where the budget comes from goes under the table."""
    from rich.console import Console

    from actune.tune.report import LevelResult, Report, render

    report = Report("bench", "resnet18", "CPU (x86_64)", 16 * 2**30,
                    "simulated 16 GiB device (no GPU found; set --budget)", "estimate", "batch",
                    {"resolution": 32})
    report.levels = [LevelResult("L0", 64, 1.0, samples_per_s=219.2),
                     LevelResult("L3", 64, 0.89, samples_per_s=194.8)]
    console = Console(record=True, width=80)
    render(report, console)
    lines = console.export_text().splitlines()
    assert lines[0] == ("actune bench: resnet18, CPU (x86_64), budget 16.0 GiB, estimate, "
                        "resolution 32")
    assert all(len(line) <= 80 for line in lines)
    assert "budget 16.0 GiB: simulated 16 GiB device (no GPU found; set --budget)" in lines
