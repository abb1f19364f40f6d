"""Searches side by side in forked processes: the same rows as one after another."""

import multiprocessing.queues
import os
import signal
import time

import pytest
import torch
from torch import nn

from actune.memory import Budget
from actune.tune import probe, run
from actune.tune.alternatives import parse_configs
from actune.tune.parallel import can_fork, run_searches
from actune.tune.workload import Workload, builtin

pytestmark = pytest.mark.skipif(not can_fork(), reason="searches are forked on Linux only")


def _square(item, on_probe):
    on_probe(item, item)
    on_probe(item, -item)
    return item * item, os.getpid()


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_each_result_comes_back_and_trials_reach_the_parent(workers):
    seen = []
    out = dict(run_searches([1, 2, 3, 4], _square, lambda item, p: seen.append((item, p)),
                            workers, cost=lambda item: item))
    assert {i: r[0] for i, r in out.items()} == {0: 1, 1: 4, 2: 9, 3: 16}
    assert sorted(seen) == sorted((i, s * i) for i in (1, 2, 3, 4) for s in (1, -1))
    forked = {pid for _, pid in out.values()} - {os.getpid()}
    assert len(forked) == (0 if workers == 1 else 4)  # one process a search


def _fails(item, on_probe):
    raise ValueError(f"the model file's build_model failed for {item}")


def test_an_error_in_a_search_is_raised_in_the_parent():
    with pytest.raises(ValueError, match="build_model failed for a") as err:
        list(run_searches(["a", "b"], _fails, None, 2))
    assert any("in the search's process" in note for note in err.value.__notes__)


def _until_interrupted(item, on_probe):
    try:
        for _ in range(400):  # 20 s at most
            on_probe(item, 1)
            time.sleep(0.05)
    except KeyboardInterrupt:
        return f"best so far of {item}"
    return "not interrupted"


def test_ctrl_c_interrupts_every_running_search_once_and_keeps_their_answers():
    first = []

    def ctrl_c(item, p):  # one Ctrl-C, at the first trial; later trials arrive as usual
        if not first:
            first.append(item)
            raise KeyboardInterrupt

    got = []
    with pytest.raises(KeyboardInterrupt):
        for _i, row in run_searches(["x", "y", "z"], _until_interrupted, ctrl_c, 2):
            got.append(row)
    # the search that sent the trial was searching and keeps its answer; the other may not
    # have begun (nothing to keep); z never started
    assert f"best so far of {first[0]}" in got
    assert set(got) <= {"best so far of x", "best so far of y"}


def _interrupted_while_sending(item, on_probe):
    try:
        on_probe(item, 1)  # the parent's interrupt lands as the queue starts its sender
        time.sleep(5)
    except KeyboardInterrupt:
        return f"kept {item}"
    return "not interrupted"


def test_an_interrupt_landing_while_a_search_sends_a_trial_reaches_the_search(monkeypatch):
    start_sender = multiprocessing.queues.Queue._start_thread

    def interrupted(queue):
        os.kill(os.getpid(), signal.SIGUSR1)  # in the forked search's process
        start_sender(queue)

    monkeypatch.setattr(multiprocessing.queues.Queue, "_start_thread", interrupted)
    assert dict(run_searches(["a", "b"], _interrupted_while_sending, None, 2)) == {
        0: "kept a", 1: "kept b"}


def _ends_silently(item, on_probe):
    os._exit(0)


def test_a_search_that_ends_without_its_row_is_an_error_not_an_endless_wait():
    with pytest.raises(RuntimeError, match="search of a ended without a result"):
        list(run_searches(["a", "b"], _ends_silently, None, 2))


def _blocks() -> nn.Module:
    """Four repeated blocks (for ckpt), small enough that a trial takes milliseconds."""
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 256),
                         nn.Sequential(*(nn.Sequential(nn.Linear(256, 256), nn.LayerNorm(256),
                                                       nn.GELU()) for _ in range(4))),
                         nn.Linear(256, 10))


def _batch(n: int):
    return torch.randn(n, 1, 8, 8), torch.randint(0, 10, (n,))


def test_levels_side_by_side_give_the_rows_of_levels_one_after_another():
    """Same answers, peaks and trials, in the order asked for; L5 takes L4's search and the
    checkpointed configuration its own warmed-up model."""
    workload = Workload("blocks", _blocks, _batch)
    levels = parse_configs("L0,L3,L4,L5,ckpt")
    reports = {}
    for jobs in (1, 2):
        probe._WARM.clear()
        settings = run.Settings(Budget(16 << 20, "test"), "estimate", "cpu", "CPU", jobs=jobs)
        seen = []
        reports[jobs] = run.maxbatch(workload, levels, settings,
                                     on_probe=lambda c, p, seen=seen: seen.append(c.name))
        assert sorted(set(seen)) == ["L0", "L3", "L4", "ckpt"]
    one, two = ([(r.level, r.value, r.peak_bytes, r.probes, r.note) for r in reports[j].levels]
                for j in (1, 2))
    assert two == one
    assert [r[0] for r in one] == ["L0", "L3", "L4", "L5", "ckpt"]
    assert one[3][1] == one[2][1] and "estimated as L4" in one[3][4]
    assert all(r[1] and r[1] > 8 for r in one)


def test_trials_of_one_model_share_its_build_and_warm_up():
    """The second level's trial takes the first one's warmed-up model; its peak is what a
    trial building its own model finds."""
    workload = builtin("tinycnn")
    builds = []
    original = workload.factory

    def counted(**sizes):
        builds.append(sizes)
        return original(**sizes)

    workload.factory = counted
    probe._WARM.clear()
    shared = [probe.Trial(workload, level, {}).peak(32).total for level in ("L0", "L3", "L2")]
    assert len(builds) == 1
    fresh = []
    for level in ("L0", "L3", "L2"):
        probe._WARM.clear()
        fresh.append(probe.Trial(workload, level, {}).peak(32).total)
    assert shared == fresh and len(builds) == 4
    probe._WARM.clear()
    probe.Trial(workload, "L3", {}, "measure").peak(4)  # real tensors: built per trial
    probe.Trial(workload, "L3", {}, "measure").peak(4)
    assert len(builds) == 6


def test_ctrl_c_keeps_the_rows_that_came_back_in_the_order_asked_for():
    """The costliest searches start first; interrupted after the first trial, the running
    searches send their best so far and the report keeps them (L0, never started, is left
    out)."""
    workload = Workload("blocks", _blocks, _batch)
    settings = run.Settings(Budget(16 << 20, "test"), "estimate", "cpu", "CPU", jobs=2)
    kept, reports, first = [], [], []

    def ctrl_c(config, probe):  # one Ctrl-C, at the first trial
        if not first:
            first.append(config.name)
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run.maxbatch(workload, parse_configs("L0,L3,L4"), settings, on_probe=ctrl_c,
                     on_level=lambda report: (kept.append([r.level for r in report.levels]),
                                              reports.append(report)))
    # the search that sent the trial is kept; the other one too unless it had not begun
    assert kept[-1] in (["L3", "L4"], ["L3"], ["L4"]) and first[0] in kept[-1]
    # each row holds its best so far: the largest batch that fitted among its trials, None
    # before any did (a search may also have ended before the interrupt reached it, on a
    # loaded machine where the parent reads the first trial late: then its row is complete)
    for row in reports[-1].levels:
        assert row.value == max((p["size"] for p in row.probes if p["fits"]), default=None)
    assert any(row.value for row in reports[-1].levels)


def test_an_interrupt_while_a_row_measures_its_peak_keeps_the_answer():
    """A Ctrl-C that reaches a search as it ends, while it measures the peak at its answer,
    leaves the row with its answer, marked incomplete, instead of losing it."""
    config = parse_configs("L3")[0]
    row = run.new_row(config, 96, probes=[{"size": 96, "fits": True, "peak": 1}], complete=True)

    def interrupted():
        raise KeyboardInterrupt

    run._fill_at(row, interrupted, config)
    assert row.value == 96 and not row.complete and row.peak_bytes is None
    peak = probe.Trial(Workload("blocks", _blocks, _batch), "L3", {}).peak(8)
    run._fill_at(row, lambda: peak, config)
    assert row.peak_bytes == peak.total
