"""The ``actune`` command line: parses arguments and renders results; the work is elsewhere.

One module per family of commands, each registering its commands on :data:`app` when
imported (in the order ``--help`` lists them)."""

from actune.cli.app import app

# isort: off
from actune.cli import tuning  # noqa: F401 - maxbatch, scale, bench
from actune.cli import training  # noqa: F401 - train
from actune.cli import tools  # noqa: F401 - numerics, summary, info, kernels
# isort: on

__all__ = ["app", "main"]


def main() -> None:
    """The ``actune`` console script."""
    app()
