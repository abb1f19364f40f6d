"""The session's packed-storage cache: one packed copy per stored value, shared by every op
that saves it, held weakly so that backward frees each copy once its readers have run."""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

from actune.packing.saved import Saved

__all__ = ["PackedCache", "dropper"]


def dropper(table: dict, key: tuple, at: int = 1) -> Callable[[weakref.ref], None]:
    """A weak reference's callback that removes ``table[key]`` if the entry still holds that
    reference at index ``at`` (not a later entry under the same key)."""
    def drop(ref: weakref.ref) -> None:
        entry = table.get(key)
        if entry is not None and entry[at] is ref:
            del table[key]
    return drop


class PackedCache:
    """Packed values by :func:`~actune.session.accounting.storage_key`."""

    def __init__(self) -> None:
        self.entries: dict[tuple, tuple] = {}

    def find(self, key: tuple) -> Saved | None:
        entry = self.entries.get(key)
        if entry is None:
            return None
        alive, saved = entry
        return None if alive() is None else saved()  # a freed storage's address can come back

    def remember(self, key: tuple, t: torch.Tensor, saved: Saved) -> None:
        """Later savers of ``t`` (cache ``key``) share ``saved`` while ``t`` lives (which keeps
        the storage whose address the key holds alive: a plain weak reference, cheaper than
        one to the storage; a saver handed another tensor object of the same view, after ``t``
        is gone, packs its own copy) and something else holds ``saved``: the cache holds it
        weakly, so that backward frees each packed value once its readers have run (not at
        the end of the context: a loop inside one ``compressed()`` would keep every step's),
        and the entry goes with it."""
        self.entries[key] = (weakref.ref(t), weakref.ref(saved, dropper(self.entries, key)))

    def clear(self) -> None:
        self.entries.clear()
