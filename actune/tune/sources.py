"""Which workload a user named: a model file, a built-in model or a Hugging Face config.

One resolver for the tuner's trials (a ``Workload.source`` string, rebuilt in a child
process) and the command line (its options), so the two never disagree.
"""

from __future__ import annotations

from pathlib import Path

from actune.tune.hf_workload import hf_workload
from actune.tune.workload import Workload, WorkloadError, builtin, load

__all__ = ["AmbiguousSourceError", "from_source", "resolve"]


class AmbiguousSourceError(WorkloadError):
    """The options name no model, or two at once."""


def resolve(model_file: Path | str | None = None, model: str | None = None,
            hf: str | None = None, hf_class: str | None = None) -> Workload:
    """The model file's workload, the Hugging Face config's (``hf``: a directory, a
    config.json or a hub ID; ``hf_class`` its model class), or the built-in ``model``'s.
    Raises :class:`AmbiguousSourceError` naming what to fix when the choice is ambiguous."""
    if hf is not None:
        if model_file is not None:
            raise AmbiguousSourceError("give a model file or --hf, not both")
        return hf_workload(hf, hf_class)
    if hf_class is not None:
        raise AmbiguousSourceError("--hf-class names the class of an --hf model: give --hf too")
    if model_file is not None:
        return load(model_file)
    if model is None:
        raise AmbiguousSourceError("name a model file, a built-in model or a Hugging Face config")
    return builtin(model)


def from_source(source: str) -> Workload:
    """The workload a ``Workload.source`` string names (``hf:SPEC#CLASS``,
    ``builtin:NAME`` or a model file's path)."""
    if source.startswith("hf:"):
        spec, _, cls = source[3:].partition("#")
        return resolve(hf=spec, hf_class=cls or None)
    if source.startswith("builtin:"):
        return resolve(model=source[len("builtin:"):])
    return resolve(model_file=source)
