"""Optimization levels: immutable specs of what is compressed, and how.

``L0``..``L5`` are named instances of :class:`Level`; a custom level is one more instance
(``Level("mine", matmul_bits=4, other_bits=2)``), not a new code path. Nothing here is global
mutable state: several models can train at different levels in one process.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import asdict, dataclass, replace

from actune import tunables
from actune.packing.codebooks import WIDTHS
from actune_kernels import layout

__all__ = ["LEVELS", "UNIFORM_GROUP_SIZES", "Level", "get_level", "mixed", "parse_levels",
           "uniform"]


@dataclass(frozen=True)
class Level:
    """What a level compresses.

    ``matmul_bits``: bits for the saved inputs of convolutions, linear layers and matmuls (whose
    weight gradients need them); ``other_bits``: bits for every other saved floating activation
    (norm inputs, activation-function derivatives, softmax outputs). ``None`` keeps them exact.
    ``masks``: ReLU, dropout and max-pool keep exact 1-bit masks or compact argmax offsets
    instead of full tensors. ``offload``: packed activations go to pinned host memory during
    forward and come back in backward (CUDA only). ``defrag``: turn PyTorch's expandable
    segments on for the process (unless the allocator configuration sets them either way) and
    release cached allocator blocks between forward and backward (CUDA only). ``min_numel``:
    smaller tensors are kept as they are (packing them gains nothing). ``nonlinear_bits``: bits
    for the saved tensors a backward reads through a nonlinearity, where rounding leaves a small
    bias (attention's q and k, which enter the recomputed softmax; the inputs a checkpointed
    region is recomputed from); ``None`` keeps them exact. ``sensitive_bits``: bits for the
    saved tensors whose rounding noise reaches every gradient before them (the loss's
    probabilities, the root of backward; attention's v, which sets the small gradients of q and
    k; the two operands of a gated product, each multiplying the other's whole gradient);
    ``None``: ``other_bits``. ``boundary_bits``: bits for the inputs a checkpointed region keeps
    to recompute itself from (``None``: ``nonlinear_bits``). ``avg_bits``: mixed precision: an
    allocator (:class:`actune.autoprec.allocator.AutoPrecision`) gives each compressed tensor, and
    each
    sample of it, 1, 2, 4 or 8 bits, ``avg_bits`` on average, more where the gradient is
    sensitive (levels named ``"2b"``, ``"1.25b"``...; see :func:`get_level`).
    ``gelu_input_bits``: GELU keeps its input rounded at these bits, outside the allocator's
    budget; its backward computes the derivative from that copy, and the matmul that reads its
    output rebuilds the output from it instead of keeping a copy of its own (one 4-bit copy
    for two tensors: the bytes of a 2-bit derivative and a 2-bit output, with several times
    less noise in both). ``None``: the derivative is kept (below). ``derivative_codes``: where
    GELU's input is not kept, and in compiled graphs (whose statistics would count the one copy
    as one saved tensor), its derivative is kept as the index of its nearest level among
    ``2 ** derivative_codes`` fixed ones (:mod:`actune.packing.codebooks`: deterministic, outside
    the
    allocator's budget) instead of rounded at ``other_bits``; ``None``: rounded.
    """

    name: str
    matmul_bits: int | None = None
    other_bits: int | None = None
    masks: bool = False
    group_size: int = layout.DEFAULT_GROUP_SIZE
    offload: bool = False
    defrag: bool = False
    min_numel: int = 1024
    nonlinear_bits: int | None = None
    sensitive_bits: int | None = None
    boundary_bits: int | None = None
    avg_bits: float | None = None
    derivative_codes: int | None = None
    gelu_input_bits: int | None = None
    description: str = ""

    def __post_init__(self) -> None:
        for field in ("matmul_bits", "other_bits", "nonlinear_bits", "sensitive_bits",
                      "boundary_bits", "gelu_input_bits"):
            bits = getattr(self, field)
            if bits is not None:
                try:
                    layout.check_bits(bits)
                except ValueError as err:
                    raise ValueError(f"Level {self.name!r}: {field}: {err}") from None
        layout.check_group_size(self.group_size)
        if self.derivative_codes not in (None, *WIDTHS):
            raise ValueError(f"Level {self.name!r}: derivative_codes must be one of "
                             f"{WIDTHS} or None, got {self.derivative_codes!r}")
        if self.avg_bits is not None:
            if not 1 <= self.avg_bits <= 8:
                raise ValueError(f"Level {self.name!r}: avg_bits must be within [1, 8], got "
                                 f"{self.avg_bits}")
            if self.matmul_bits is None and self.other_bits is None:
                raise ValueError(f"Level {self.name!r}: avg_bits needs something compressed "
                                 f"(set matmul_bits or other_bits)")
        if self.defrag and not self.offload:
            raise ValueError(f"Level {self.name!r}: defrag builds on offload; set offload=True")

    @property
    def sensitive_width(self) -> int | None:
        """The bits of the tensors ``sensitive_bits`` names (``other_bits`` if it is unset,
        None where those are kept exact)."""
        if self.other_bits is None:
            return None
        return self.sensitive_bits if self.sensitive_bits is not None else self.other_bits

    @property
    def boundary_width(self) -> int | None:
        """The bits of a checkpointed region's inputs (None: exact)."""
        return self.boundary_bits if self.boundary_bits is not None else self.nonlinear_bits

    @property
    def narrow_width(self) -> int | None:
        """The bits of a layer's input with 1/:data:`tunables.WIDENING` of its output's features or
        fewer (an adapter's rank-r input to its B matrix): ``nonlinear_bits`` if wider than
        ``matmul_bits`` (None where those are kept exact). Such an input costs a fraction of
        its output's memory, and its noise goes whole into the weight gradient."""
        if self.matmul_bits is None:
            return None
        return max(self.matmul_bits, self.nonlinear_bits or 0)

    def widens(self, features_in: int, features_out: int) -> bool:
        """Does a layer of these widths take :attr:`narrow_width` for its input?"""
        return features_in * tunables.WIDENING <= features_out

    @functools.cached_property  # (read on every routed call; the level is frozen)
    def exact(self) -> bool:
        """True when nothing is compressed (plain PyTorch)."""
        return self.matmul_bits is None and self.other_bits is None and not self.masks

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Level:
        return cls(**json.loads(text))

    def with_(self, **changes) -> Level:
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)


L0 = Level("L0", description="exact PyTorch, nothing compressed")
L1 = Level("L1", matmul_bits=4, masks=True,
           description="4-bit inputs of convolutions and linear layers, exact 1-bit masks; "
                       "the rest exact")
L2 = Level("L2", matmul_bits=4, other_bits=4, masks=True, nonlinear_bits=8,
           description="4 bits for every compressed activation, 1-bit masks")
L3 = Level("L3", matmul_bits=2, other_bits=2, masks=True, nonlinear_bits=8, sensitive_bits=4,
           avg_bits=2.0, derivative_codes=2, gelu_input_bits=4,
           description="2 bits on average, per layer and per sample where the gradient is "
                       "sensitive (mixed precision), GELU's input at 4 bits for its derivative "
                       "and its output, 1-bit masks (the default)")
L4 = L3.with_(name="L4", offload=True,
              description="L3 + packed activations offloaded to pinned host memory (CUDA)")
L5 = L4.with_(name="L5", defrag=True,
              description="L4 + expandable segments (turned on for the process unless the "
                          "allocator configuration sets them) and cache release between "
                          "passes (CUDA)")

LEVELS: dict[str, Level] = {lv.name: lv for lv in (L0, L1, L2, L3, L4, L5)}


_AVERAGE = re.compile(r"^(\d+(?:\.\d+)?)\s*(?:b|bits?)?$", re.IGNORECASE)
_UNIFORM = re.compile(r"^u(\d)$", re.IGNORECASE)


#: A uniform level's groups where they differ from L3's. At 8 bits the codes outweigh their
#: group's two 16-bit statistics: groups of 64 pay 1/16 of the codes' bytes for them, the
#: share a 2-bit group of 256 pays, and each step is set by the extremes of 64 values, not
#: 256 (less noise in every rounded tensor; docs/benchmarks.md, "Vision models"). Widths
#: below 8 keep L3's groups, so a uniform level is the like-for-like baseline of a mixed one.
UNIFORM_GROUP_SIZES = {8: 64}


def uniform(bits: int) -> Level:
    """``bits`` for every compressed activation, no allocator (named ``"u2"``, ``"u4"``): the
    baseline that mixed precision at the same average is measured against."""
    layout.check_bits(bits)
    return L3.with_(name=f"u{bits}", matmul_bits=bits, other_bits=bits, avg_bits=None,
                    sensitive_bits=None, derivative_codes=None, gelu_input_bits=None,
                    group_size=UNIFORM_GROUP_SIZES.get(bits, L3.group_size),
                    description=f"{bits} bits for every compressed activation, 1-bit masks")


def mixed(avg_bits: float) -> Level:
    """L3 with bits allocated by gradient sensitivity, ``avg_bits`` on average (named
    ``"2b"``, ``"1.25b"``). Without an allocator attached it packs at the widest width not
    above the average."""
    if not 1 <= avg_bits <= 8:
        raise ValueError(f"average bits must be within [1, 8], got {avg_bits:g}")
    width = max(b for b in layout.SUPPORTED_BITS if b <= avg_bits)
    # (a 4-bit input for GELU's derivative and output, or 2-bit codes of its derivative,
    # beat rounding both at 2 bits, not at 4)
    narrow = width <= 2
    return L3.with_(name=f"{avg_bits:g}b", matmul_bits=width, other_bits=width,
                    avg_bits=float(avg_bits),
                    derivative_codes=L3.derivative_codes if narrow else None,
                    gelu_input_bits=L3.gelu_input_bits if narrow else None,
                    description=f"{avg_bits:g} bits on average, allocated where the gradient "
                                f"is sensitive; 1-bit masks")


def get_level(level: str | Level) -> Level:
    """The level named ``level`` (``"L3"``, case-insensitive), a mixed-precision level from
    its average bits (``"2b"``, ``"1.25"``, ``"3bits"``), or ``level`` itself."""
    if isinstance(level, Level):
        return level
    text = str(level).strip()
    found = LEVELS.get(text.upper())
    if found is None:
        average = _AVERAGE.match(text)
        if average:
            return mixed(float(average.group(1)))
        bits = _UNIFORM.match(text)
        if bits and int(bits.group(1)) in layout.SUPPORTED_BITS:
            return uniform(int(bits.group(1)))
        raise ValueError(f"unknown level {level!r}; valid levels: {', '.join(LEVELS)}, "
                         f"an average number of bits such as 2b or 1.25b (mixed precision), "
                         f"or u1, u2, u4, u8 (the same bits everywhere)")
    return found


def parse_levels(text: str) -> list[Level]:
    """Levels from ``"L0-L5"``, ``"L0,L3"`` or ``"L3"``."""
    names = list(LEVELS)
    out: list[Level] = []
    text = text.replace(" ", "")
    for part in filter(None, (p.strip() for p in text.split(","))):
        if "-" in part:
            a, b = (get_level(x).name for x in part.split("-", 1))
            i, j = names.index(a), names.index(b)
            if i > j:
                raise ValueError(f"level range {part!r} runs backwards; write {b}-{a}")
            out.extend(LEVELS[n] for n in names[i:j + 1])
        else:
            out.append(get_level(part))
    if not out:
        raise ValueError(f"no levels in {text!r}; valid levels: {', '.join(names)}")
    return list(dict.fromkeys(out))
