"""The searching tuning jobs, maxbatch and scale, one level after another (bench, which
times real steps, is :mod:`actune.tune.bench`); the helpers the jobs share for their rows.

Each returns a :class:`actune.tune.report.Report`; ``on_level`` is called after every finished level
(the CLI writes its JSON then, so finished levels are never lost) and ``on_probe`` after every
trial (progress). Levels whose device cannot do what they add (offload on a CPU) are run and
say so in their note.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from actune import tunables
from actune.memory import Budget
from actune.memory.gpu_model import GpuModel
from actune.tune.alternatives import Config, get_config
from actune.tune.ceiling import parameter_bytes, parameter_state_ceiling
from actune.tune.compiled import calibrate, compiled_answer, measure_point
from actune.tune.parallel import available_workers, run_searches
from actune.tune.probe import Trial, warm_up
from actune.tune.report import LevelResult, Report
from actune.tune.search import Probe, SearchResult, largest_fitting
from actune.tune.selective import block_names, describe_whole, fewer_checkpoints
from actune.tune.sharding import Sharding, per_rank_parameter_share, release
from actune.tune.workload import Workload

#: Scale searches run over integers: depth and width in steps of 1/8 of the default size,
#: resolution in pixels.
SCALE_UNITS = {"depth": 0.125, "width": 0.125, "resolution": 1}


@dataclass
class Settings:
    """Where and how to run."""

    budget: Budget
    mode: str = "estimate"
    device: str = "cpu"
    device_name: str = "CPU"
    sharding: Sharding | None = None  # per rank of a data-parallel run
    jobs: int | None = None  # searches side by side (None: one per core); estimates only
    gpu: GpuModel | None = None  # an estimate for this GPU kind (its allocator, workspaces)
    margin: float = 0.0  # the share of the budget kept free (already taken off ``budget``)
    # maxbatch / scale --compile: also answer for a compiled step with this backend
    compile_backend: str | None = None

    def workers(self, searches: int) -> int:
        """How many searches run side by side: estimates of one device only (real steps
        would share the machine they measure; a sharded job's fake process group is this
        process's), at most one per core, ``jobs`` or searches."""
        if self.mode != "estimate" or self.sharding is not None:
            return 1
        return max(1, min(searches, self.jobs or available_workers()))

    def trial(self, workload: Workload, config, sizes: dict) -> Trial:
        gpu = self.gpu if self.mode == "estimate" else None
        if gpu is not None and get_config(config).level.defrag:
            gpu = gpu.defragmenting()  # (L5 turns expandable segments on)
        return Trial(workload, config, sizes, self.mode, self.device, self.round_to,
                     self.sharding, gpu)

    @property
    def fixed(self) -> dict:
        return self.sharding.describe() if self.sharding else {}

    @property
    def report_fields(self) -> dict:
        """What a report says of where its estimates point (the GPU kind, the margin)."""
        profile = self.gpu.profile.name if self.gpu and self.mode == "estimate" else ""
        return {"device_profile": profile, "margin": self.margin}

    @property
    def search_budget(self) -> int:
        """The budget the search predicts against: estimated and measured trials both report
        their peak, so every mode fits a line through them (and verifies the prediction)."""
        return self.budget.bytes

    @property
    def round_to(self) -> int | None:
        # estimates of a GPU budget round storages like the CUDA caching allocator
        return 512 if self.mode == "estimate" else None


def level_note(config: Config, settings: Settings, real_steps: bool = False) -> str:
    """A level's note in the report: what its device cannot do (offload on a CPU)."""
    if config.offloads and torch.device(settings.device).type != "cuda":
        if settings.mode == "estimate" and not real_steps:
            return "offload simulated"
        return "CPU: no offload, = L3" if real_steps and config.level.offload else \
            "CPU: no offload"
    return ""


def add_row(report: Report, row: LevelResult, on_level: Callable | None) -> None:
    """Append a finished (or interrupted) level; an interrupted one ends the job."""
    report.levels.append(row)
    report.relate_to_l0()
    if on_level:
        on_level(report)
    if not row.complete:
        raise KeyboardInterrupt


def _fill_at(row: LevelResult, peak_of: Callable[[], object], config: Config) -> None:
    """:func:`fill_peak` with the peak ``peak_of()`` measures. Interrupted while it measures (a
    Ctrl-C that reaches a search as it ends), the row keeps its answer without the peak's
    figures, marked incomplete, instead of being lost."""
    try:
        peak = peak_of()
    except KeyboardInterrupt:
        row.complete = False
        return
    fill_peak(row, peak, config)


def fill_peak(row: LevelResult, peak, config: Config) -> None:
    """Copy a peak's figures into a report row."""
    row.peak_bytes, row.host_bytes = peak.total, peak.host
    row.reserved_bytes = peak.reserved or None
    if not (config.offload and config.level.exact):  # save_on_cpu's hooks replace actune's:
        row.activation_bytes = peak.saved  # what they hold is counted as host bytes only
        row.uncompressed_activation_bytes = peak.saved_uncompressed
    row.peak_parts = {k: getattr(peak, k) for k in ("parameters", "gradients", "optimizer",
                                                     "activations", "temporaries", "other")}
    row.peak_at = peak.where
    row.kept_exact = dict(peak.kept_exact)


def probe_reporter(on_probe: Callable | None, config: Config) -> Callable[[Probe], None] | None:
    """``on_probe`` bound to ``config`` (None without one)."""
    return (lambda p: on_probe(config, p)) if on_probe else None


def new_row(config: Config, value, **fields) -> LevelResult:
    """A report row for ``config``'s answer ``value``."""
    return LevelResult(config.name, value, base_level=config.level.name,
                       checkpoint=config.checkpoint, offload=config.offload,
                       whole_blocks=list(config.whole), **fields)


def probe_dicts(probes: list[Probe]) -> list[dict]:
    """A search's trials as the report's JSON keeps them."""
    return [{"size": p.size, "fits": p.fits, "peak": p.peak} for p in probes]


def maxbatch(workload: Workload, levels: list, settings: Settings, *,
             sizes: dict | None = None, start: int = 8, multiple_of: int = 1,
             maximum: int | None = None, on_probe: Callable | None = None,
             on_level: Callable[[Report], None] | None = None) -> Report:
    """Largest batch per level (or configuration, :mod:`actune.tune.alternatives`) under the
    budget."""
    sizes = sizes or {}
    shown = {workload.label(k): v for k, v in sizes.items()}  # (a language model's tokens)
    report = Report("maxbatch", workload.name, settings.device_name, settings.budget.bytes,
                    settings.budget.source, settings.mode, "batch",
                    {**shown, **settings.fixed}, precision=workload.precision,
                    **settings.report_fields)
    _each_level(report, levels, settings, on_level, on_probe,
                lambda level, probed: _maxbatch_level(workload, level, settings, sizes, start,
                                                      multiple_of, maximum, probed),
                warm=lambda level: settings.trial(workload, level, sizes))
    if settings.compile_backend:
        def probe_of(config: Config) -> Callable[[int], Probe]:
            trial = settings.trial(workload, config, sizes)
            return lambda n: trial.probe(n, settings.budget.bytes)
        _add_compiled(report, workload, levels, settings, on_level, probe_of,
                      lambda row: (sizes, min(start, int(row.value)), int(row.value)),
                      lambda n: (sizes, n), start=start, step=multiple_of, maximum=maximum)
    return report


def _add_compiled(report: Report, workload: Workload, levels: list, settings: Settings,
                  on_level: Callable | None, probe_of: Callable[[Config], Callable[[int], Probe]],
                  where: Callable[[LevelResult], tuple[dict, int, int | None]],
                  sizes_of: Callable[[int], tuple[dict, int]], *, start: int, step: int,
                  maximum: int | None, unit: float = 1) -> None:
    """Each answered row's compiled figures (:mod:`actune.tune.compiled`): compiled steps on
    the CPU at ``where(row)`` (sizes, first batch, the largest batch to calibrate at) against
    the eager estimate there, the search again on that line, and a compiled step at the
    answer (``sizes_of(size)``: its sizes and batch). A configuration estimated as an
    earlier one shares its figures; one that does not compile says so in its note."""
    done: dict[Config, LevelResult] = {}
    backend = settings.compile_backend
    for config, row in zip((get_config(lv) for lv in levels), report.levels, strict=True):
        twin = done.get(_estimated_as(config))
        if twin is not None:
            for name in ("compiled_ratio", "compiled_value", "compiled_batches",
                         "compiled_checked"):
                setattr(row, name, getattr(twin, name))
            continue
        if not row.value:
            continue
        sizes, batch, largest = where(row)
        try:
            cal = calibrate(workload, config, sizes, batch, backend, largest)
            answer = compiled_answer(
                probe_of(config), cal, settings.budget.bytes,
                lambda n, c=config: measure_point(workload, c, *sizes_of(n), backend),
                start=start, step=step, maximum=maximum)
        except Exception as err:  # (a configuration torch.compile cannot run, say)
            row.note = "; ".join(n for n in (row.note, f"compiled step failed: "
                                             f"{type(err).__name__}: {err}"[:160]) if n)
            continue
        row.compiled_ratio, row.compiled_batches = (answer.calibration.ratio,
                                                     list(answer.measured))
        row.compiled_value = answer.value * unit if answer.value else None
        row.compiled_checked = answer.checked
        done[_estimated_as(config)] = row
        if on_level:
            on_level(report)


def _each_level(report: Report, levels: list, settings: Settings, on_level: Callable | None,
                on_probe: Callable | None, search: Callable[[Config, Callable], LevelResult],
                warm: Callable[[Config], Trial] | None = None,
                on_row: Callable[[LevelResult], None] | None = None) -> None:
    """Search each configuration (``search(config, on_probe)``), side by side in forked
    processes where the settings allow (:mod:`actune.tune.parallel`), and add the rows in the
    order asked for, each as soon as those before it are in. In an estimate, a configuration
    that runs as an earlier one takes its answer. ``warm(config)``: a trial whose model the
    searches share, built before they are forked off. The fake process group of a sharded job
    ends with it."""
    configs = [get_config(lv) for lv in levels]
    gpu = settings.gpu is not None
    twins = {i for i, c in enumerate(configs) if settings.mode == "estimate" and any(
        _estimated_as(e, gpu) == _estimated_as(c, gpu) for e in configs[:i])}
    searched = [i for i in range(len(configs)) if i not in twins]
    workers = settings.workers(len(searched))
    rows: dict[int, LevelResult] = {}
    done: list[tuple[Config, LevelResult]] = []
    with _sharded(settings):
        if workers > 1 and warm is not None:  # one model with checkpointing, one without
            for config in {configs[i].checkpoint: configs[i] for i in searched}.values():
                warm_up(warm(config))
        try:
            for k, row in run_searches([configs[i] for i in searched], search, on_probe,
                                       workers, cost=_search_cost):
                rows[searched[k]] = row
                while len(done) < len(configs):
                    config = configs[len(done)]
                    row = rows.get(len(done)) or _same_as_before(done, config, settings)
                    if row is None:
                        break
                    if on_row:
                        on_row(row)
                    done.append((config, row))
                    add_row(report, row, on_level)
        except KeyboardInterrupt:  # keep every row that came back (searched side by side, a
            late = [rows[i] for i in range(len(done), len(configs)) if i in rows]  # later
            if late:  # level may have finished before an earlier one), in the order asked for
                report.levels.extend(late)
                report.relate_to_l0()
                if on_level:
                    on_level(report)
            raise


def _search_cost(config: Config) -> int:
    """A configuration's trials' relative cost in an estimate: each kind of tensor it packs,
    offloading and recomputation add operations to every step."""
    level = config.level
    return ((level.matmul_bits is not None) + (level.other_bits is not None)
            + config.offloads + 2 * config.checkpoint)


def _estimated_as(config: Config, gpu: bool = False) -> Config:
    """What an estimate runs ``config`` as, names apart: the CUDA allocator settings
    (``defrag``, L5) do not change a tracked step, so L5 is estimated as L4, except by a GPU
    model (which empties the allocator's cache where L5 does)."""
    level = config.level.with_(name="", description="",
                               defrag=config.level.defrag and gpu)
    return dataclasses.replace(config, level=level)


def _same_as_before(done: list[tuple[Config, LevelResult]], config: Config,
                    settings: Settings) -> LevelResult | None:
    """In an estimate, a configuration that runs as one already searched (L5 after L4) takes
    its row under its own name, with no trials of its own (none is repeated)."""
    if settings.mode != "estimate":
        return None
    gpu = settings.gpu is not None
    twin = _estimated_as(config, gpu)
    earlier = next(((c, row) for c, row in done
                    if _estimated_as(c, gpu) == twin and row.complete), None)
    if earlier is None:
        return None
    note = "; ".join(n for n in (level_note(config, settings), f"estimated as {earlier[0].name}")
                     if n)
    return dataclasses.replace(earlier[1], level=config.name, base_level=config.level.name,
                               note=note, probes=[])


@contextlib.contextmanager
def _sharded(settings: Settings):
    try:
        yield
    finally:
        if settings.sharding is not None:
            release()  # the fake process group the trials ran in


def _maxbatch_level(workload: Workload, level: Config, settings: Settings, sizes: dict,
                    start: int, multiple_of: int, maximum: int | None,
                    on_probe: Callable | None) -> LevelResult:
    trials: dict[Config, Trial] = {}

    def search(config: Config, begin: int) -> SearchResult:
        trial = trials[config] = settings.trial(workload, config, sizes)
        return largest_fitting(
            lambda n: trial.probe(n, settings.budget.bytes), start=begin,
            step=multiple_of, maximum=maximum, budget=settings.search_budget,
            on_probe=probe_reporter(on_probe, config))

    level, result, probes, blocks = _choosing(workload, level, settings, search(level, start),
                                              search, lambda value: (sizes, value))
    row = new_row(level, result.value, probes=probe_dicts(probes),
               complete=result.complete, capped=result.capped,
               note=_notes(level, settings, blocks))
    if result.value:
        _fill_at(row, lambda: trials[level].peak(result.value), level)
    return row


def _choosing(workload: Workload, config: Config, settings: Settings, result: SearchResult,
              search: Callable[[Config, int], SearchResult],
              step_at: Callable[[int], tuple[dict, int]],
              ) -> tuple[Config, SearchResult, list[Probe], int | None]:
    """With checkpointing: the blocks chosen (:func:`choose_blocks`) at ``result``'s answer,
    searched again from there (``search(config, begin)``) and chosen again at the new answer,
    up to :data:`tunables.CHECKPOINT_CHOICE_ROUNDS` times. The configuration, the last search's
    result, every
    probe made, and how many blocks the model has (None: nothing chosen)."""
    probes, blocks = list(result.probes), None
    for _ in range(tunables.CHECKPOINT_CHOICE_ROUNDS):
        chosen, blocks = choose_blocks(workload, config, settings,
                                        result.value if result.complete else None, step_at)
        if chosen == config:
            break
        config, result = chosen, search(chosen, int(result.value))
        probes += result.probes
    return config, result, probes, blocks


def choose_blocks(workload: Workload, config: Config, settings: Settings, value: int | None,
                   step_at: Callable[[int], tuple[dict, int]]) -> tuple[Config, int | None]:
    """With checkpointing: ``config`` with the blocks chosen by :mod:`actune.tune.selective`
    at the answer ``value`` (``step_at(value)``: the sizes and batch of its step), and how
    many blocks the model has. Chosen by estimates in either mode: a measured search then
    runs the blocks an estimate would."""
    if not config.checkpoint or not value:
        return config, None
    sizes, batch = step_at(int(value))
    estimating = dataclasses.replace(settings, mode="estimate")
    names = block_names(estimating.trial(workload, config, sizes))
    return fewer_checkpoints(
        config, lambda c: estimating.trial(workload, c, sizes).peak(batch), names), len(names)


def _notes(config: Config, settings: Settings, blocks: int | None) -> str:
    """A row's note: :func:`level_note`, and the blocks run whole under checkpointing."""
    whole = describe_whole(config.whole, blocks) if config.whole and blocks else ""
    return "; ".join(n for n in (level_note(config, settings), whole) if n)


def scale(workload: Workload, levels: list, settings: Settings, dim: str, batch: int,
          *, multiple_of: int | None = None, maximum: float | None = None,
          on_probe: Callable | None = None,
          on_level: Callable[[Report], None] | None = None) -> Report:
    """Largest ``dim`` (depth, width or resolution; ``tokens`` for a language model) per
    level at a fixed batch."""
    dim = workload.dim_of(dim)
    workload.require(dim)
    label = workload.label(dim)
    unit = SCALE_UNITS[dim]
    default = workload.dims[dim]
    start = max(1, round(default / unit))
    step = multiple_of or (8 if dim == "resolution" else 1)
    cap = round(maximum / unit) if maximum else None
    if dim == "resolution" and workload.max_resolution:  # (its position embeddings)
        cap = min(cap or workload.max_resolution, workload.max_resolution)
    if cap is not None and cap < step:
        smallest = f"{step * unit:g}x" if dim != "resolution" else \
            f"{step} {'tokens' if workload.tokens else 'pixels'}"
        raise ValueError(f"--max {maximum or cap:g} is below the smallest {label} step "
                         f"({smallest}); give a larger --max")
    report = Report("scale", workload.name, settings.device_name, settings.budget.bytes,
                    settings.budget.source, settings.mode, label,
                    {"batch": batch, **settings.fixed}, precision=workload.precision,
                    **settings.report_fields)

    def ceiling(row: LevelResult) -> None:  # the first level with an answer sets it
        if dim in ("depth", "width") and row.value and report.ceiling is None:
            report.ceiling = _ceiling(workload, dim, unit, row.value,
                                      row.peak_parts["optimizer"], settings)

    _each_level(report, levels, settings, on_level, on_probe,
                lambda level, probed: _scale_level(workload, level, settings, dim, batch, unit,
                                                   start, step, cap, probed),
                warm=lambda level: settings.trial(workload, level, {dim: start * unit}),
                on_row=ceiling)
    if settings.compile_backend:
        def probe_of(config: Config) -> Callable[[int], Probe]:
            def probe(n: int) -> Probe:
                p = settings.trial(workload, config, {dim: n * unit}).probe(
                    batch, settings.budget.bytes)
                return dataclasses.replace(p, size=n)  # (the size searched: the dimension)
            return probe
        _add_compiled(report, workload, levels, settings, on_level, probe_of,
                      lambda row: ({dim: start * unit}, min(batch, 8), batch),
                      lambda n: ({dim: n * unit}, batch), start=start, step=step,
                      maximum=cap, unit=unit)
    return report


def _scale_level(workload: Workload, level: Config, settings: Settings, dim: str, batch: int,
                 unit: float, start: int, step: int, cap: int | None,
                 on_probe: Callable | None) -> LevelResult:
    trials: dict[int, Trial] = {}

    def search(config: Config, begin: int) -> SearchResult:
        trials.clear()

        def probe(n: int) -> Probe:
            trials[n] = settings.trial(workload, config, {dim: n * unit})
            p = trials[n].probe(batch, settings.budget.bytes)
            return Probe(n, p.fits, p.peak)  # the size searched is the dimension, not the batch

        return largest_fitting(probe, start=begin, step=step, maximum=cap,
                               budget=settings.search_budget,
                               on_probe=probe_reporter(on_probe, config))

    level, result, probes, blocks = _choosing(workload, level, settings, search(level, start),
                                              search, lambda value: ({dim: value * unit},
                                                                     batch))
    value = result.value * unit if result.value else None
    row = new_row(level, value,
               probes=[{**p, "size": p["size"] * unit} for p in probe_dicts(probes)],
               complete=result.complete, capped=result.capped,
               note=_notes(level, settings, blocks))
    if value:
        _fill_at(row, lambda: trials[result.value].peak(batch), level)
    return row


def _ceiling(workload: Workload, dim: str, unit: float, value: float, optimizer_bytes: int,
             settings: Settings) -> float | None:
    """The parameter-state ceiling, with the optimizer's bytes per parameter byte read off
    ``optimizer_bytes`` (those of a trial at ``value``) and, under sharding, each rank's
    share."""
    share, extra = per_rank_parameter_share(settings.sharding)
    full = parameter_bytes(workload, **{dim: value})
    if not full:
        return None
    optimizer = optimizer_bytes / (full * share)
    return parameter_state_ceiling(workload, dim, unit, settings.budget.bytes,
                                   share * (2 + optimizer) + extra)
