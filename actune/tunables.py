"""actune's tunables: thresholds and sizes that trade memory, speed and accuracy.

Every module reads them from here at the time of use (``tunables.NAME``), so a test or a user
can change one for a run, with ``monkeypatch.setattr(tunables, "NAME", value)`` or
:func:`patch`. The reasons for each default are given beside it; the measurements behind them
are in docs/benchmarks.md.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

# -- packing ---------------------------------------------------------------------------------

#: Tensors below this many elements join a shared kernel call in ``quantize_many``: for larger
#: ones a call's fixed cost is small beside their work and the shared buffer's copy is not
#: (docs/benchmarks.md, "Step speed on the CPU").
SMALL_PACK = 8192
#: The same for ``dequantize_many``.
SMALL_UNPACK = 16384

#: CPU outputs from this size up are mapped fresh by the C library on every call (glibc maps
#: requests over 32 MiB directly and never reuses them); they are asked for transparent huge
#: pages, since faulting them in 4 KiB at a time bounds dequantize at clone's speed
#: (docs/benchmarks.md, "Kernels").
HUGE_OUTPUT_BYTES = 32 << 20

#: Compiled graphs pack CPU tensors with actune's opaque kernel ops rather than with torch ops
#: that Inductor fuses into their producers (docs/benchmarks.md, "torch.compile"). False: the
#: torch ops, a GPU's form, everywhere.
GRAPH_OPS_ON_CPU = True

#: Dequantized values under this many elements are kept for their next reader: a few MiB at
#: most, held between two backward nodes, for one dequantization less.
KEEP_NUMEL = 1 << 20

# -- the session -----------------------------------------------------------------------------

#: Storages remembered as counted before the dead ones are dropped (a loop inside one context).
SEEN_LIMIT = 4096

# -- rules and substitutes -------------------------------------------------------------------

#: Convolutions whose input has fewer elements run PyTorch's own backward (and smaller batch
#: norms and ReLUs their own): the memory the ordered backward saves is small there and its
#: Python overhead per call is not.
LEAN_NUMEL = 1 << 20

#: Functions whose generic pointwise rule is remembered (a bound on a cache keyed by function).
GENERIC_RULE_CACHE = 4096

#: Elements of the logits a cross entropy handles at a time (a float32 slice of 16 MiB).
LOSS_SLICE = 1 << 22

#: Attention-map elements one slice of the math path holds (64 MiB in float32): the maps
#: (scores, probabilities, their gradients) live a slice at a time, not a batch at a time.
ATTENTION_MAP_SLICE = 1 << 24

#: A linear layer with as many outputs as a token embedding of its model has rows is taken for
#: the model's head from this many (smaller vocabularies' logits are small).
HEAD_MIN_CLASSES = 8192

#: The most logits one chunk of the chunked LM loss holds while the hidden states are smaller
#: (a float32 chunk of 16 MiB); where they are larger a chunk holds about as many logits as
#: they hold values, so a long batch is not cut into thousands of tiny matmuls.
CHUNK_ELEMENTS = 1 << 22

# -- levels and the bit allocator ------------------------------------------------------------

#: A layer whose output has this many times its input's features or more keeps its input at
#: ``Level.narrow_width``.
WIDENING = 8

#: Items x capacity cells up to which ``allocate()`` solves the knapsack exactly (beyond:
#: the greedy solution).
EXACT_CELLS = 2_000_000

# -- the tuner -------------------------------------------------------------------------------

#: Kept free on a GPU for the CUDA context, cuBLAS/cuDNN workspaces and allocator slack.
GPU_RESERVE = 1536 * 2**20

#: Seconds one isolated GPU trial may take.
TRIAL_TIMEOUT = 600

#: Built and warmed-up fake models of recent estimate trials kept for the next configuration.
WARM_MODELS = 4

#: Rounds of choosing the checkpointed blocks, each at the answer the last one reached.
CHECKPOINT_CHOICE_ROUNDS = 3

#: Seconds between checks that no parallel search's child died without sending its row.
POLL_SECONDS = 1.0

#: The compiled tuner's CPU steps stay within this: its calibration batch doubles towards the
#: eager answer while the estimate does, and an answer beyond it is extrapolated, not checked.
COMPILED_CPU_CAP = 2 * 2**30
#: Searches on a corrected line after a compiled answer that was checked did not fit.
COMPILED_REFINE = 3


@contextlib.contextmanager
def patch(**values: object) -> Iterator[None]:
    """Set tunables for the duration of a ``with`` block: ``with tunables.patch(LEAN_NUMEL=0):``.
    An unknown name raises ``AttributeError`` (a typo does not pass silently)."""
    module = globals()
    for name in values:
        if name not in module or not name.isupper():
            raise AttributeError(f"actune.tunables has no tunable {name!r}")
    previous = {name: module[name] for name in values}
    module.update(values)
    try:
        yield
    finally:
        module.update(previous)
