"""Which blocks +ckpt checkpoints (actune.tune.selective)."""

import dataclasses
import json

import pytest
from typer.testing import CliRunner

from actune.cli import app
from actune.memory import Peak
from actune.tune.alternatives import get_config
from actune.tune.selective import block_at, describe_whole, fewer_checkpoints
from tests.tune.test_alternatives import TWO_BLOCKS

NAMES = ["layer1.0", "layer1.1", "layer2.0", "layer2.1"]


@pytest.mark.parametrize(("where", "block"), [
    ("backward, layer1.1.bn3 (BatchNorm2d)", "layer1.1"),
    ("backward, layer2.0 (Bottleneck)", "layer2.0"),
    ("backward, layer1.10.conv1 (Conv2d)", None),  # (not layer1.1's: a name, not a prefix)
    ("forward, layer1.1.bn3 (BatchNorm2d)", None),  # a forward peak: no recomputation
    ("backward, fc (Linear)", None),
    ("optimizer step", None),
])
def test_the_block_whose_backward_holds_the_peak(where, block):
    assert block_at(where, NAMES) == block


def _peaks(recompute: list[float], forward: float, per_whole: float):
    """A step's peak: the forward's, which grows ``per_whole`` with each block run whole, or
    the recomputation of the last block (in backward order) still checkpointed."""
    calls = []

    def peak_of(config) -> Peak:
        calls.append(config.whole)
        left = [i for i, n in enumerate(NAMES) if n not in config.whole]
        fwd = forward + per_whole * len(config.whole)
        bwd = recompute[left[0]] if left else 0.0
        where = (f"backward, {NAMES[left[0]]}.conv (Conv2d)" if bwd > fwd
                 else "forward, layer2.1.relu (ReLU)")
        total = int(max(fwd, bwd))
        return Peak(total, 0, 0, 0, total, 0, 0, 0, 0, where=where)

    return peak_of, calls


def test_blocks_whose_recomputation_sets_the_peak_run_whole_while_it_falls():
    config = get_config("L3+ckpt")
    # recomputing layer1.0 costs most, then layer1.1; the forward grows as blocks run whole
    peak_of, calls = _peaks([130, 120, 90, 80], forward=100, per_whole=5)  # alone: 120
    chosen = fewer_checkpoints(config, peak_of, NAMES)
    # 130 (layer1.0) -> 120 (layer1.1) -> 110 (the forward's): the peak left the blocks
    assert chosen == dataclasses.replace(config, whole=("layer1.0", "layer1.1"))
    assert calls == [(), ("layer1.0",), ("layer1.0", "layer1.1"), tuple(NAMES)]
    assert chosen.name == "L3+ckpt"


def test_the_level_alone_when_no_choice_of_blocks_peaks_lower():
    config = get_config("L3+ckpt")
    peak_of, _ = _peaks([130, 125, 124, 123], forward=60, per_whole=10)  # alone: 100
    chosen = fewer_checkpoints(config, peak_of, NAMES)
    assert chosen.whole == tuple(NAMES)
    assert describe_whole(chosen.whole, 4).startswith("no block checkpointed")
    assert describe_whole(("layer1.0",), 4) == ("3 of 4 blocks checkpointed; run whole (their "
                                                 "recomputation set the peak): layer1.0")


def test_a_forward_peak_keeps_every_block_checkpointed():
    config = get_config("ckpt")
    peak_of, calls = _peaks([50, 50, 50, 50], forward=100, per_whole=5)
    assert fewer_checkpoints(config, peak_of, NAMES) == config
    assert calls == [(), tuple(NAMES)]


def test_scale_chooses_the_blocks_too(tmp_path):
    model_file = tmp_path / "net.py"
    model_file.write_text(TWO_BLOCKS)
    out = tmp_path / "r.json"
    result = CliRunner().invoke(app, ["scale", "--dim", "width", str(model_file), "--batch",
                                      "8192", "--budget", "64MiB", "--levels", "L3,L3+ckpt",
                                      "--json", str(out)], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    rows = {r["level"]: r for r in json.loads(out.read_text())["levels"]}
    # at L3 the second block's recomputation holds more than it saves: it runs whole; the
    # first's saves a little (23 KB of a 62 MB peak at width 1.25x since the loss keeps its
    # targets in a byte each): it stays checkpointed
    assert rows["L3+ckpt"]["whole_blocks"] == ["2"]
    assert rows["L3+ckpt"]["value"] >= rows["L3"]["value"]
    assert "L3+ckpt: 1 of 2 blocks checkpointed" in result.output


def test_bench_times_the_blocks_maxbatch_would_choose(tmp_path):
    model_file = tmp_path / "net.py"
    model_file.write_text(TWO_BLOCKS)
    out = tmp_path / "r.json"
    result = CliRunner().invoke(app, ["bench", str(model_file), "--batch", "11000", "--levels",
                                      "L0,L3+ckpt", "--steps", "1", "--warmup", "0",
                                      "--json", str(out)], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    rows = {r["level"]: r for r in json.loads(out.read_text())["levels"]}
    assert rows["L3+ckpt"]["whole_blocks"] == ["2"] and rows["L3+ckpt"]["samples_per_s"] > 0
    # at each level's own largest batch: searched again with the blocks chosen
    result = CliRunner().invoke(app, ["bench", str(model_file), "--at-max", "--budget", "24MiB",
                                      "--levels", "L3,L3+ckpt", "--steps", "1", "--warmup",
                                      "0", "--json", str(out)], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    rows = {r["level"]: r for r in json.loads(out.read_text())["levels"]}
    assert rows["L3+ckpt"]["whole_blocks"]  # (here the parameters set the peak: none)
    assert rows["L3+ckpt"]["value"] >= rows["L3"]["value"]
