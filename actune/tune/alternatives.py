"""What a user would pick instead of (or beside) a level: activation checkpointing and CPU
offload, as configurations the tuner runs like levels.

* ``ckpt``: PyTorch's activation checkpointing (``torch.utils.checkpoint``, non-reentrant)
  around each block of the model. The blocks are what the model file's
  ``checkpoint_blocks(model)`` returns, else the repeated children of the model's
  ``ModuleList``/``Sequential`` containers (a ResNet's bottlenecks, a transformer's layers).
* ``offload``: ``torch.autograd.graph.save_on_cpu(pin_memory=True)``: every tensor saved for
  backward is kept in host memory (counted as host bytes, like L4's). In an estimate the
  saved tensors go to the ``meta`` device, which the tracker counts as host; on the CPU there
  is nothing to offload to (noted).
* ``lce``: a causal LM's head and loss in chunks of tokens, the logits never whole
  (:func:`actune.chunk_loss`, exact), alone; every compressing level has it already, as
  :func:`actune.compress` turns it on (``L3+lce`` is ``L3``).
* ``L3+ckpt``, ``L3+offload``, ...: a level with either, compressing what they still keep.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.utils.checkpoint as checkpoint
from torch import nn

from actune import Level, get_level, offload_simulated, parse_levels

__all__ = ["MODIFIERS", "Config", "apply_checkpointing", "parse_configs", "repeated_blocks"]

L0 = get_level("L0")

#: Modifiers a configuration may add to a level ("L3+ckpt"), alone meaning L0 with it.
MODIFIERS = ("ckpt", "offload", "lce")


@dataclass(frozen=True)
class Config:
    """A level, with activation checkpointing, CPU offload of every saved tensor and/or a
    causal LM's loss in chunks."""

    level: Level
    checkpoint: bool = False
    offload: bool = False
    # the head and loss in chunks (:func:`actune.chunk_loss`) at an exact level; a
    # compressing level has it already (this is then False, and the name shows no "+lce")
    chunked_loss: bool = False
    # with ``checkpoint``: the blocks (by their names in the model) that run whole, not
    # checkpointed (:mod:`actune.tune.selective` leaves out those whose recomputation sets the
    # peak); the configuration's name does not change
    whole: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.chunked_loss and not self.level.exact:
            object.__setattr__(self, "chunked_loss", False)  # (the level has it: one name)

    @property
    def chunks_loss(self) -> bool:
        """Does a causal LM's step compute its loss in chunks (see :attr:`chunked_loss`)?"""
        return self.chunked_loss or not self.level.exact

    @property
    def name(self) -> str:
        flags = (self.checkpoint, self.offload, self.chunked_loss)
        mods = [m for m, on in zip(MODIFIERS, flags, strict=True) if on]
        return "+".join(mods if self.level is L0 and mods else [self.level.name, *mods])

    def to_json(self) -> dict:
        return {"level": self.level.to_json(), "checkpoint": self.checkpoint,
                "offload": self.offload, "chunked_loss": self.chunked_loss,
                "whole": list(self.whole)}

    @classmethod
    def from_json(cls, data: dict) -> Config:
        return cls(Level.from_json(data["level"]), bool(data["checkpoint"]),
                   bool(data["offload"]), bool(data.get("chunked_loss", False)),
                   tuple(data.get("whole", ())))

    @property
    def run_level(self) -> Level:
        """The level the step runs at: a compressing level with ``offload`` offloads its own
        packed buffers (as L4 does), under this configuration's name."""
        if self.offload and not self.level.exact:
            return self.level.with_(name=self.name, offload=True)
        return self.level

    @property
    def offloads(self) -> bool:
        return self.offload or self.level.offload

    @contextlib.contextmanager
    def saving(self, device: str) -> Iterator[None]:
        """The context a step's forward runs in, inside :func:`actune.compressed` (the
        innermost saved-tensor hooks are the ones autograd calls): for an exact level with
        ``offload``, every saved tensor to host memory (pinned on CUDA, the ``meta`` device
        in an estimate, unchanged on the CPU)."""
        if not self.offload or not self.level.exact:
            yield
        elif offload_simulated():
            with torch.autograd.graph.saved_tensors_hooks(_to_meta, _from_meta):
                yield
        elif torch.device(device).type == "cuda":  # pragma: no cover - needs a GPU
            with torch.autograd.graph.save_on_cpu(pin_memory=True):
                yield
        else:
            yield  # the CPU: the host is the device


def _to_meta(t: torch.Tensor):
    return t.device, t.to("meta")


def _from_meta(packed) -> torch.Tensor:
    device, t = packed
    return torch.empty_like(t, device=device)


def parse_configs(text: str) -> list[Config]:
    """Configurations from ``"L0-L5"``, ``"L0,L3,ckpt,L3+ckpt,offload,lce"``: levels as
    :func:`actune.parse_levels` reads them, each optionally with ``+ckpt``, ``+offload``
    and/or ``+lce``; a modifier alone is L0 with it."""
    out: list[Config] = []
    for part in filter(None, (p.strip() for p in text.replace(" ", "").split(","))):
        tokens = part.split("+")
        mods = [t.lower() for t in tokens if t.lower() in MODIFIERS]
        rest = [t for t in tokens if t.lower() not in MODIFIERS]
        if len(rest) > 1:
            raise ValueError(f"{part!r} names more than one level; write one level and any of "
                             f"+{', +'.join(MODIFIERS)} (for example L3+ckpt)")
        levels = parse_levels(rest[0]) if rest else [L0]
        if mods and len(levels) > 1:
            raise ValueError(f"{part!r}: a modifier goes with one level (L3+ckpt), not a range")
        out.extend(Config(lv, "ckpt" in mods, "offload" in mods, "lce" in mods)
                   for lv in levels)
    if not out:
        raise ValueError(f"no levels in {text!r}; valid levels: L0-L5, u2, 2b, and ckpt, "
                         f"offload, lce, L3+ckpt")
    return list(dict.fromkeys(out))


def get_config(name: str | Level | Config) -> Config:
    """The configuration named ``name`` (one level, optionally with modifiers)."""
    if isinstance(name, Config):
        return name
    if isinstance(name, Level):
        return Config(name)
    found = parse_configs(name)
    if len(found) != 1:
        raise ValueError(f"{name!r} names {len(found)} configurations; give one (L3, L3+ckpt)")
    return found[0]


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks to checkpoint by default: the children of every ``ModuleList`` or
    ``Sequential`` that holds two or more modules of one class with children of their own
    (not inside a block already found), in the model's order."""
    blocks: list[nn.Module] = []
    inside: set[int] = set()
    for module in model.modules():
        if id(module) in inside or not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(module.children())
        if (len(children) >= 2 and len({type(c) for c in children}) == 1
                and next(children[0].children(), None) is not None):
            blocks.extend(children)
            inside.update(id(m) for c in children for m in c.modules())
    return blocks


def apply_checkpointing(model: nn.Module, blocks: list[nn.Module] | None = None,
                        find: Callable[[nn.Module], list[nn.Module]] = repeated_blocks,
                        whole: tuple[str, ...] = ()) -> int:
    """Run each block's forward under non-reentrant ``torch.utils.checkpoint``, in place,
    except the blocks named in ``whole`` (their names in ``model``); returns how many blocks
    were checkpointed. Raises ``ValueError`` if the model has no blocks."""
    blocks = list(find(model) if blocks is None else blocks)
    if not blocks:
        raise ValueError(
            f"no blocks to checkpoint in {type(model).__name__}: it has no ModuleList or "
            f"Sequential of repeated blocks. Define checkpoint_blocks(model) in the model "
            f"file, returning the modules to checkpoint (docs/tuning.md)")
    if whole:
        names = {id(m): n for n, m in model.named_modules()}
        blocks = [b for b in blocks if names.get(id(b)) not in whole]
    if blocks:
        _no_cache(model)
    for block in blocks:
        block.forward = _checkpointed(block.forward)
    return len(blocks)


def _no_cache(model: nn.Module) -> None:
    """Turn off the key-value caches of a Hugging Face model (each stack's config: T5's
    decoder has its own copy), as its gradient checkpointing does: a cache filled during the
    forward changes what the recomputation does (T5's decoder reads its cross-attention keys
    and values from it instead of projecting them again), and checkpointing then fails."""
    for module in model.modules():
        config = getattr(module, "config", None)
        if getattr(config, "use_cache", False):
            config.use_cache = False


def _checkpointed(forward: Callable) -> Callable:
    def run(*args, **kwargs):
        return checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run
