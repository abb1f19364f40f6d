"""ActNN-style figure: training throughput against batch size, one line per level."""

from __future__ import annotations

from pathlib import Path

from actune.tune.report import Report


def throughput_curves(workload, levels: list, settings, report: Report, sizes: dict,
                      path: Path, points: int = 4) -> None:
    """Measure samples/s at up to ``points`` batch sizes (halving from each level's batch in
    ``report``) and draw them to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from actune.tune.bench import throughput

    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    for level, row in zip(levels, report.levels, strict=True):
        if not row.value:
            continue
        batches = sorted({max(1, int(row.value) >> k) for k in range(points)})
        speeds = [throughput(workload, level, b, sizes, settings.device, steps=3, warmup=1)
                  for b in batches]
        ax.plot(batches, speeds, marker="o", label=level.name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("samples / s")
    ax.set_title(f"{report.model} on {report.device}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
