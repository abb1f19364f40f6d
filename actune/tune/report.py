"""Results as rich tables and as JSON (schema ``actune.result/2``, see docs/tuning.md)."""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from actune.formatting import describe_exact, human_bytes

SCHEMA = "actune.result/2"


@dataclass
class LevelResult:
    """One level's row: a search result (maxbatch/scale) or a measurement (bench)."""

    level: str  # the configuration's name: "L3", "ckpt", "L3+ckpt", "offload"
    value: float | None = None  # max batch / max scale / the batch used by bench
    ratio: float | None = None  # value (or throughput, for bench) relative to L0
    peak_bytes: int | None = None
    activation_bytes: int | None = None
    uncompressed_activation_bytes: int | None = None
    host_bytes: int = 0
    peak_parts: dict = field(default_factory=dict)  # parameters, gradients, optimizer, ...
    peak_at: str = ""  # phase and innermost module at the peak, e.g. "forward, layer1.2.bn3"
    kept_exact: dict = field(default_factory=dict)  # bytes kept exact, by the op saving them
    samples_per_s: float | None = None
    # bench at one batch (the steps are timed in rounds): the median of the per-round speed
    # ratios to L0 (``ratio`` then) and their middle half (both ends under four rounds), the
    # run's own spread of ``ratio``
    round_ratio: float | None = None
    ratio_spread: list | None = None
    probes: list[dict] = field(default_factory=list)
    complete: bool = True
    capped: bool = False
    note: str = ""
    base_level: str = ""  # the level alone ("L3" for "L3+ckpt")
    checkpoint: bool = False  # activation checkpointing around each block
    whole_blocks: list = field(default_factory=list)  # with checkpoint: blocks run whole
    offload: bool = False  # every saved tensor (or the level's packed ones) in host memory
    compiled: bool = False  # bench --compile: the same level's step under torch.compile
    # a GPU's reserved peak (max_memory_reserved): predicted by a device profile's allocator
    # model in an estimate, measured on a GPU; None where not known
    reserved_bytes: int | None = None
    # maxbatch / scale --compile: compiled steps measured on the CPU at two batches against
    # the eager estimate there (how much the compiled peak grows per byte the estimate does),
    # and the answer for a compiled step (actune.tune.compiled)
    compiled_ratio: float | None = None
    compiled_value: float | None = None
    compiled_batches: list | None = None
    compiled_checked: bool = False  # a compiled step at compiled_value measured to fit

    @property
    def compression(self) -> float | None:
        if self.activation_bytes and self.uncompressed_activation_bytes:
            return self.uncompressed_activation_bytes / self.activation_bytes
        return None


@dataclass
class Report:
    """A whole command's result."""

    command: str
    model: str
    device: str
    budget_bytes: int
    budget_source: str
    mode: str
    dim: str
    fixed: dict = field(default_factory=dict)  # e.g. {"batch": 64} for scale
    levels: list[LevelResult] = field(default_factory=list)
    # bench --at-max: the fastest configuration that fits, {"level", "batch", "samples_per_s"}
    best: dict | None = None
    # scale --dim depth|width: the size at which parameters, gradients and optimizer state
    # alone fill the budget (the physical limit every level approaches)
    ceiling: float | None = None
    # bench: the largest batch at L0 and at L3 under the budget, estimated, and how long that
    # took ({"L0": 763, "L3": 2011, "seconds": 3.0}; a level that fits nothing: None)
    answer: dict | None = None
    #: the step's precision (Lightning's names): ratios are against its own L0
    precision: str = "32-true"
    #: the GPU kind an estimate predicted for (``--device-profile`` or the GPU found), "" none
    device_profile: str = ""
    #: the share of the budget kept free (``--margin``): ``budget_bytes`` is what is left
    margin: float = 0.0

    def choose_best(self) -> None:
        """Name the fastest level whose batch fits (``bench --at-max``)."""
        timed = [r for r in self.levels if r.value and r.samples_per_s]
        top = max(timed, key=lambda r: r.samples_per_s, default=None)
        self.best = None if top is None else {
            "level": top.level, "batch": int(top.value), "samples_per_s": top.samples_per_s}

    def to_json(self) -> dict:
        out = {"schema": SCHEMA, **{k: v for k, v in asdict(self).items() if k != "levels"}}
        out["levels"] = [{**asdict(r), "compression": r.compression} for r in self.levels]
        return out

    def relate_to_l0(self) -> None:
        """Fill each level's ratio to L0 (the value, or bench's throughput)."""
        base = next((r for r in self.levels if r.level == "L0"), None)
        for r in self.levels:
            if base is None:
                r.ratio = None
            elif self.command == "bench" and r.round_ratio is not None:
                r.ratio = r.round_ratio  # (a median of ratios: inside its own spread)
            elif self.command == "bench":
                r.ratio = (r.samples_per_s / base.samples_per_s
                           if r.samples_per_s and base.samples_per_s else None)
            else:
                r.ratio = r.value / base.value if r.value and base.value else None


def write_json(report: Report | dict, path: str | Path) -> None:
    """Write a report (or any JSON-able dict) to ``path``. A regular file is replaced
    atomically (a temporary file in the same folder, then a rename; the file keeps its
    permissions, a new one gets the usual ones; a symbolic link stays and its target is
    replaced); a device or pipe (``/dev/null``, ``/dev/stdout``) is written in place, never
    replaced."""
    text = json.dumps(report.to_json() if isinstance(report, Report) else report, indent=2)
    path = Path(path)
    if path.exists() and not path.is_file() and not path.is_dir():
        with open(path, "w") as f:
            f.write(text + "\n")
        return
    if path.is_symlink():  # write through the link: the link stays
        path = path.resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    # a new name in the same folder, created with the usual permissions (0o666 less the umask)
    tmp = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text + "\n")
        if path.exists():  # replaced: keep the file's own permissions
            os.chmod(tmp, path.stat().st_mode & 0o7777)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _fmt_value(dim: str, value: float | None) -> str:
    if value is None:
        return "does not fit"
    if dim in ("depth", "width"):
        return f"{value:g}x"  # multiples of 1/8 in full: 4.125x, 24.375x
    return f"{int(value):,}"


#: Printed under estimated results: what an estimate leaves out (docs/tuning.md).
ESTIMATE_CAVEAT = ("estimate: tensors only; workspaces operators allocate inside (cuDNN, "
                   "oneDNN) come on top: for a GPU give --device-profile, or confirm with "
                   "--mode measure")
#: Printed under estimates for a GPU kind (the allocator model): what it rests on.
GPU_MODEL_CAVEAT = ("estimate for {profile}: tensors, cuBLAS workspaces and op temporaries "
                    "through the CUDA caching allocator's rules; fits = reserved peak within "
                    "the budget (docs/tuning.md, \"On which GPU\")")
#: Printed under results measured on the CPU, where the tracker sees tensors only.
CPU_MEASURE_CAVEAT = ("measured on the CPU: tensors only; oneDNN's internal copies come on "
                      "top (docs/tuning.md)")


def _compiled_lines(report: Report) -> list[str]:
    """maxbatch / scale --compile: what the answers become for a compiled step."""
    rows = [r for r in report.levels if r.compiled_ratio is not None]
    if not rows:
        return []
    ratios = ", ".join(f"{r.level} {r.compiled_ratio:.2f}x" for r in rows)
    answers = ", ".join(f"{r.level} {_fmt_value(report.dim, r.compiled_value)}"
                        f"{' (measured)' if r.compiled_checked else ' (extrapolated)'}"
                        if r.compiled_value else f"{r.level} none" for r in rows)
    label = "batch" if report.dim == "batch" else report.dim
    at = "; ".join(f"{r.level} " + ", ".join(f"{b:,}" for b in r.compiled_batches)
                   for r in rows)
    return [f"torch.compile (steps measured on the CPU at batches {at}): the compiled peak "
            f"grows {ratios} as fast as the eager estimate; largest {label} compiled: "
            f"{answers}"]


def render(report: Report, console: Console) -> None:
    """Print ``report`` as a table, with the device and budget in the title (where the
    budget comes from on a line under the table: the title stays within 80 columns)."""
    title = (f"actune {report.command}: {report.model}, {report.device}, budget "
             f"{human_bytes(report.budget_bytes)}, {report.mode}")
    if report.precision != "32-true":
        title += f", {report.precision}"
    if report.fixed:
        title += ", " + ", ".join(f"{k} {v}" for k, v in report.fixed.items())
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)  # (a title would wrap to its width)
    show_host = report.command != "bench" and any(r.host_bytes for r in report.levels)
    show_reserved = any(r.reserved_bytes for r in report.levels)
    label = "max batch" if report.dim == "batch" else f"max {report.dim}"
    peak_cols = ("peak", "reserved") if show_reserved else ("peak",)
    cols = (("batch", "samples/s", "vs L0", *peak_cols, "saved", "ratio")
            if report.command == "bench" else
            (label, "vs L0", *peak_cols, "saved", "ratio") + (("host",) if show_host else ()))
    table.add_column("level", no_wrap=True)
    for col in cols:
        table.add_column(col, justify="right", no_wrap=True)
    notes: dict[str, list[str]] = {}
    for r in report.levels:
        ratio = f"{r.ratio:.2f}x" if r.ratio else "-"
        saved = human_bytes(r.activation_bytes)
        compression = f"{r.compression:.1f}x" if r.compression else "-"
        value = _fmt_value(report.dim, r.value) if r.complete or r.value else "-"
        peaks = (human_bytes(r.peak_bytes),) + ((human_bytes(r.reserved_bytes),)
                                                if show_reserved else ())
        if report.command == "bench":
            sps = f"{r.samples_per_s:,.1f}" if r.samples_per_s else "-"
            row = (_fmt_value("batch", r.value), sps, ratio, *peaks, saved, compression)
        else:
            row = (value, ratio, *peaks, saved, compression)
            if show_host:
                row += (human_bytes(r.host_bytes) if r.host_bytes else "-",)
        note = "; ".join(n for n in (r.note, "" if r.complete else "interrupted",
                                     "capped by --max" if r.capped else "") if n)
        table.add_row(r.level, *row)
        if note:
            notes.setdefault(note, []).append(r.level)
    # long notes go under the table, levels with the same note on one line: the columns stay
    # within 80 (a pipe, a CI log)
    lines = [f"budget {human_bytes(report.budget_bytes)}: {report.budget_source}"]
    spread = [f"{r.level} {r.ratio_spread[0]:.2f}-{r.ratio_spread[1]:.2f}x"
              for r in report.levels if r.ratio_spread]
    if spread:  # a difference from L0 inside this is the machine's noise, not a result
        lines.append("vs L0, the middle half of the rounds: " + ", ".join(spread))
    lines += [f"{', '.join(levels)}: {note}" for note, levels in notes.items()]
    places: dict[str, list[str]] = {}
    for r in report.levels:
        if r.peak_at:
            places.setdefault(r.peak_at, []).append(r.level)
    if places:
        lines.append("peak at: " + "; ".join(f"{', '.join(levels)} {where}"
                                              for where, levels in places.items()))
    lines += [f"{r.level} {describe_exact(r.kept_exact)}" for r in report.levels
              if sum(r.kept_exact.values()) >= 2**20]  # (under 1 MiB: not worth a line)
    lines += _compiled_lines(report)
    if report.mode == "estimate" and report.device_profile:  # what the figures rest on
        lines.append(GPU_MODEL_CAVEAT.format(profile=report.device_profile))
        split = [r for r in report.levels
                 if r.reserved_bytes and r.peak_bytes and r.reserved_bytes > 1.15 * r.peak_bytes]
        if split:  # what a user can do about it
            worst = max(split, key=lambda r: r.reserved_bytes / r.peak_bytes)
            lines.append(f"{worst.level} reserves {worst.reserved_bytes / worst.peak_bytes:.2f}x "
                         f"what it allocates (fragmentation): PYTORCH_CUDA_ALLOC_CONF="
                         f"expandable_segments:True usually recovers most of it (L5 turns "
                         f"it on for its run)")
    elif report.mode == "estimate":  # what the figures leave out
        lines.append(ESTIMATE_CAVEAT)
    elif report.device.startswith("CPU"):
        lines.append(CPU_MEASURE_CAVEAT)
    if report.ceiling is not None:
        size = _fmt_value(report.dim, report.ceiling)
        lines.insert(0, f"parameter-state ceiling: {report.dim} {size} (parameters, gradients "
                        f"and optimizer state alone fill the budget)")
    if report.best:
        b = report.best
        lines.insert(0, f"fastest within the budget: {b['level']} at batch {b['batch']:,}, "
                        f"{b['samples_per_s']:,.1f} samples/s")
    if report.answer:  # what a user came for, last
        a = report.answer
        sizes = ", ".join(f"{lv} {a[lv]:,}" if a[lv] else f"{lv} none" for lv in ("L0", "L3"))
        times = f" ({a['L3'] / a['L0']:.1f}x)" if a["L0"] and a["L3"] else ""
        lines.append(f"largest batch under {human_bytes(report.budget_bytes)}: {sizes}{times}"
                     f", estimated in {a['seconds']:.1f} s")
    console.print(escape(title), overflow="fold")
    console.print(table)
    for line in lines:
        console.print(escape(line), overflow="fold")
