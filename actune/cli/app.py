"""The ``actune`` application: its command group, consoles, and the handling every command
shares (errors phrased for the user, JSON written or a usage error, files to write checked)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape


class _FlagsWithoutType:
    """Help without a ``<bool>`` type beside flags (typer shows one for flags, ``--help``
    included, though they take no value)."""

    def get_params(self, ctx):
        params = super().get_params(ctx)
        for param in params:
            if getattr(param, "is_flag", False) and param.metavar is None:
                param.metavar = ""
        return params


class _Group(_FlagsWithoutType, typer.core.TyperGroup):
    pass


class Command(_FlagsWithoutType, typer.core.TyperCommand):
    pass


app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  cls=_Group, help="Compress saved activations to 2 bits and tune what fits "
                  "in memory.")
console = Console()
err_console = Console(stderr=True)


def _version(show: bool) -> None:
    if show:
        from actune import __version__

        console.print(f"actune {__version__}")
        raise typer.Exit()


@app.callback()
def _main(version: Annotated[bool, typer.Option(
        "--version", callback=_version, is_eager=True, help="Print the version and exit.")]
        = False) -> None:
    """Compress saved activations to 2 bits and tune what fits in memory."""


def output_file(example: str):
    """A typer callback for an option naming a file to write: rejected before any work starts
    if it is a folder, or if its folder cannot be made or written in."""

    def check(path: Path | None) -> Path | None:
        if path is None:
            return None
        if path.is_dir():
            raise typer.BadParameter(f"{path} is a folder; give a file in it, such as "
                                     f"{path / example}")
        existing = next(p for p in (path.parent.absolute(), *path.parent.absolute().parents)
                        if p.exists())
        if not existing.is_dir():
            raise typer.BadParameter(f"{existing} is a file, so {path} cannot be made")
        if not os.access(existing, os.W_OK | os.X_OK):
            raise typer.BadParameter(f"cannot write in {existing} (permission denied)")
        return path

    return check


class UsageError(Exception):
    """An error already phrased for the user."""


class NothingKept(KeyboardInterrupt):
    """Ctrl-C before a tuning job finished any level."""


@contextlib.contextmanager
def errors(debug: bool):
    """Known errors: one paragraph, exit 2 (no traceback unless --debug); Ctrl-C: exit 130."""
    from actune.tune.probe import ProbeError
    from actune.tune.workload import WorkloadError

    try:
        yield
    except KeyboardInterrupt as err:
        kept = ("no level had finished: nothing was kept" if isinstance(err, NothingKept)
                else "results of finished levels were kept")
        err_console.print(f"[yellow]interrupted[/]: {kept}")
        raise typer.Exit(130) from None
    except (WorkloadError, ProbeError, ValueError, UsageError) as err:
        if debug:
            raise
        err_console.print(f"[bold red]error:[/] {escape(str(err))}")  # ('[hf]' is no markup)
        raise typer.Exit(2) from None


def write_result(data, path: Path) -> None:
    """Write ``--json``; a write that fails (a full disk) is the user's error to fix, exit 2."""
    from actune.tune.report import write_json

    try:
        write_json(data, path)
    except OSError as err:
        raise UsageError(f"cannot write --json {path}: {err.strerror or err}") from None

