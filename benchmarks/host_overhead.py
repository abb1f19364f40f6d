"""Host time per saved tensor: what the Python around each compressed tensor costs a step.

A ResNet-18 step on inputs so small that its arithmetic is a minor part of it (batch 8,
8x8 by default: every tensor it packs has at least ``min_numel`` elements, so the same 41
are packed whatever the version) runs with the CPU kernels replaced by no-ops (the wrappers
still allocate codes, metadata and outputs): the flat layout's, the per-row layout's and the
column layout's (a layer's input packed by feature; run for real before 2026-12-07, a few
percent of a small model's step: the Llama's 0.06x). Two comparisons, each divided by the tensors
packed in the step (from ``CompressionStats``):

* ``use``: ``--level`` as a training loop and ``actune bench`` run it (no statistics sink)
  against plain PyTorch (L0, where ``compressed`` does nothing): all that actune adds, the
  function mode and the saved-tensor hooks included;
* ``accounting``: both levels with a statistics sink (L0 then runs the mode and the hooks
  too): the figure this script printed before it had the first line.

Each round runs the four steps in turn and the medians of the per-round differences are
printed (a noisy machine slows neighbouring steps alike), in this thread's CPU time, on
torch's default thread count unless ``--threads`` sets one. The Python calls a step makes
(a profile hook counts them) are printed too: a count the machine's noise does not move.

``--model resnet50`` (batch 2 at 8x8: a batch norm needs two values a channel at 1x1) and
``--model llama`` (a 4-layer Hugging Face Llama of width 64, ``--batch 1 --tokens 8``) give
whole models' figures: the last one printed, L3's host time over plain PyTorch's, is the
eager step's host cost where the arithmetic is a minor part (on this CPU the ResNet-50's
weight gradients still are most of its step; on a GPU they are the device's work).

``--instructions`` counts instead the instructions each step executes, under Valgrind's
callgrind (one process per step kind, on one thread: a thread pool's waiting would count;
``--steps`` steps counted after five): the same two differences, free of the machine's noise,
for comparing versions on a shared host (run the script with ``PYTHONPATH`` at another
checkout for its figures; the kernels are stubbed in either).

    python benchmarks/host_overhead.py [--batch 8] [--resolution 8] [--rounds 60]
    python benchmarks/host_overhead.py --model llama --batch 1 --tokens 8
    python benchmarks/host_overhead.py --model resnet50 --batch 2
    python benchmarks/host_overhead.py --instructions [--steps 4]
    python benchmarks/host_overhead.py --model llama --batch 1 --tokens 8 --floor

``--floor`` times the step instead under an empty function mode, under identity saved-tensor
hooks and under both, beside ``--level``, each over plain PyTorch: the part of the level's
host time that any design routing calls and seeing saved tensors in Python pays first.

``--real-kernels`` runs the kernels instead of no-ops: the step a CPU user runs, where the
kernels' own calls (a thread pool woken for a small tensor) count too.

    python benchmarks/host_overhead.py --model llama --batch 1 --tokens 8 --floor --real-kernels

``--api compress`` runs the level as ``actune.compress(model, level)`` does (a copy of the
model converted, its bit allocator attached: the widths allocated, as a user's training loop
runs it) instead of ``with actune.compressed(level)`` (uniform widths, no allocator).

    python benchmarks/host_overhead.py --api compress [--model llama --batch 1 --tokens 8]

``--compiled`` runs both steps under ``torch.compile`` (Inductor; the kernels stubbed in the
custom ops the graphs call): the host work a compiled step keeps, where no Python runs per op.

    python benchmarks/host_overhead.py --api compress --compiled --model llama --batch 1 \
        --tokens 64
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import ctypes
import importlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812
from torch.overrides import TorchFunctionMode

import actune
from actune.apps.zoo import resnet

#: The step clock: this thread's CPU time (``time.perf_counter`` for wall time).
CLOCK = time.thread_time


def no_op_kernels() -> None:
    """Make the CPU kernels return at once: the wrappers still allocate their outputs and
    convert their arguments, as they do around the real kernels (whichever entry points the
    version running has). The unpacking ones write zeros (a ``memset``), not nothing: values
    left as the allocator found them may be NaN, and a gradient that is not finite makes the
    bit allocator of a ``compress()``ed model collect its statistics again at every step."""
    def nothing(*args, **kwargs) -> None:
        return None

    def zeros(address: int, count: int, dtype: np.dtype) -> None:
        ctypes.memset(address, 0, count * np.dtype(dtype).itemsize)

    def unpack_at(codes_at, meta_at, bits, group_size, out_at, n, dtype, *rest) -> None:
        zeros(out_at, n, dtype)

    def unpack_columns_at(codes_at, meta_at, bits, rows, out_at, total, width, dtype,
                          *rest) -> None:
        zeros(out_at, total * width, dtype)

    def unpack(codes, meta, bits, group_size, out, *rest) -> None:
        out[...] = 0

    def unpack_rows(codes, meta, row_bits, row_offset, group_size, out, *rest) -> None:
        out[...] = 0

    stubs = {"pack": nothing, "pack_at": nothing, "pack_rows": nothing,
             "pack_columns_at": nothing, "unpack": unpack, "unpack_at": unpack_at,
             "unpack_rows": unpack_rows, "unpack_columns_at": unpack_columns_at}
    for module in ("cpu", "cpu_rows", "cpu_columns"):
        try:
            kernels = importlib.import_module(f"actune_kernels.{module}")
        except ImportError:
            continue
        for name, stub in stubs.items():
            if hasattr(kernels, name):
                setattr(kernels, name, stub)


def python_calls(fn) -> int:
    """Python and built-in function calls made while ``fn()`` runs."""
    count = 0

    def profile(frame, event, arg) -> None:
        nonlocal count
        if event in ("call", "c_call"):
            count += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count


def resnet_loss(depth: int, args: argparse.Namespace):
    model = resnet(depth, num_classes=10)  # any input size
    x = torch.randn(args.batch, 3, args.resolution, args.resolution)
    y = torch.randint(0, 10, (args.batch,))
    return model, lambda m: F.cross_entropy(m(x), y)


def llama_loss(args: argparse.Namespace):
    """A 4-layer Hugging Face Llama (width 64) on ``--batch`` x ``--tokens`` tokens."""
    try:
        import transformers
    except ImportError:
        sys.exit("--model llama needs Hugging Face transformers: pip install 'actune[hf]'")
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2))
    ids = torch.randint(0, 256, (args.batch, args.tokens))
    return model, lambda m: m(input_ids=ids, labels=ids).loss


#: --model -> (model, loss function) of the arguments.
MODELS = {"resnet18": lambda args: resnet_loss(18, args),
          "resnet50": lambda args: resnet_loss(50, args),
          "llama": llama_loss}


def make_scoped_step(args: argparse.Namespace):
    """The model and batch of ``args`` and a function running one step of them inside
    ``scope()`` (``converted``: on a copy converted by ``actune.compress`` at ``--level``);
    returns its CPU time."""
    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, loss_of = MODELS[args.model](args)
    converted = actune.compress(copy.deepcopy(model), args.level)
    step_converted = converted  # (what a step calls: compiled with --compiled)
    if args.compiled:  # (compiled at their first steps, the warm-up rounds')
        model, step_converted = torch.compile(model), torch.compile(converted)

    def step(scope: Callable[[], contextlib.AbstractContextManager],
             on_converted: bool = False) -> float:
        m = step_converted if on_converted else model
        t = CLOCK()
        with scope():
            loss = loss_of(m)
        loss.backward()
        m.zero_grad(set_to_none=True)
        return CLOCK() - t

    if not args.real_kernels:
        no_op_kernels()
    step.converted = converted
    return step


def make_step(args: argparse.Namespace, found: list):
    """:func:`make_scoped_step` at a level (with a statistics sink appending to ``found`` if
    asked); with ``--api compress`` a level other than L0 runs the converted copy, its
    statistics through ``actune.track_stats``."""
    scoped = make_scoped_step(args)

    def step(level: str, stats: bool) -> float:
        if args.api == "compress" and level != "L0":
            model = scoped.converted
            actune.track_stats(model, stats)  # (a compiled step's: counted by count_compiled)
            took = scoped((lambda: actune.count_compiled(model)) if args.compiled
                          else contextlib.nullcontext, on_converted=True)
            if stats:
                found.append(actune.stats_of(model))
            return took
        return scoped(lambda: actune.compressed(level, stats=found.append if stats else None))

    return step


def timed(args: argparse.Namespace) -> None:
    found: list[actune.CompressionStats] = []
    step = make_step(args, found)
    runs = [("L0", False), (args.level, False), ("L0", True), (args.level, True)]
    for _ in range(3):
        for run in runs:
            step(*run)
    use, accounting, ratio, plain = [], [], [], []
    for _ in range(args.rounds):
        t = [step(*run) for run in runs]
        use.append(t[1] - t[0])
        accounting.append(t[3] - t[2])
        ratio.append(t[1] / t[0])
        plain.append(t[0])
    packed = max(found[-1].packed, 1)
    calls = {run: python_calls(lambda run=run: step(*run)) for run in runs[:2]}
    print(f"{args.model} {_input(args)}, batch {args.batch}, "
          f"{torch.get_num_threads()} thread(s), {args.rounds} rounds: {packed} tensors packed "
          f"a step; host time per saved tensor {statistics.median(use) / packed * 1e6:.0f} us "
          f"(use: {args.level} against plain PyTorch), "
          f"{statistics.median(accounting) / packed * 1e6:.0f} us (accounting: both with "
          f"statistics); Python calls a step: plain {calls[runs[0]]:,}, {args.level} "
          f"{calls[runs[1]]:,} ({(calls[runs[1]] - calls[runs[0]]) / packed:.0f} a saved "
          f"tensor); host time {args.level} / plain: {statistics.median(ratio):.2f}x "
          f"({statistics.median(plain) * 1e3:.2f} ms a plain step)")


class _EmptyMode(TorchFunctionMode):
    """A function mode that runs every call as it is: the floor of any routing in Python."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _floor_scopes() -> dict[str, Callable[[], contextlib.AbstractContextManager]]:
    """What ``--floor`` times a step under, beside plain PyTorch (see ``floor``)."""
    def hooks():
        return torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)

    def both():
        stack = contextlib.ExitStack()
        stack.enter_context(hooks())
        stack.enter_context(_EmptyMode())
        return stack

    return {"plain": contextlib.nullcontext, "empty function mode": _EmptyMode,
            "identity saved-tensor hooks": hooks, "both": both}


def floor(args: argparse.Namespace) -> None:
    """The host time of a step under an empty function mode, identity saved-tensor hooks and
    both, and under ``--level``, each over plain PyTorch's (medians of per-round ratios): what
    any design that routes calls and sees saved tensors in Python costs before doing anything,
    against what actune costs."""
    step = make_scoped_step(args)
    scopes = {**_floor_scopes(), args.level: lambda: actune.compressed(args.level)}
    if args.api == "compress":  # (the converted copy opens its level itself)
        scopes[args.level] = contextlib.nullcontext

    def run(name: str) -> float:
        return step(scopes[name], on_converted=name == args.level and args.api == "compress")

    for _ in range(3):
        for name in scopes:
            run(name)
    times: dict[str, list[float]] = {name: [] for name in scopes}
    for _ in range(args.rounds):
        for name in scopes:
            times[name].append(run(name))
    ratios = {name: statistics.median(a / b for a, b in zip(t, times["plain"], strict=True))
              for name, t in times.items() if name != "plain"}
    print(f"{args.model} {_input(args)}, batch {args.batch}, {torch.get_num_threads()} "
          f"thread(s), {args.rounds} rounds: host time over plain PyTorch's "
          f"({statistics.median(times['plain']) * 1e3:.2f} ms): "
          + ", ".join(f"{name} {r:.3f}x" for name, r in ratios.items()))


def _input(args: argparse.Namespace) -> str:
    size = (f"{args.tokens} tokens" if args.model == "llama"
            else f"{args.resolution}x{args.resolution}")
    return (f"{size} ({args.api}(){', compiled' if args.compiled else ''}"
            f"{', real kernels' if args.real_kernels else ''})")


def _callgrind(*command: str) -> None:
    subprocess.run(["callgrind_control", *command, str(os.getpid())], check=True,
                   capture_output=True)


def counted_child(args: argparse.Namespace) -> None:
    """Under callgrind (started with instrumentation off): five steps, then ``--steps``
    instrumented and dumped; prints the tensors packed a step (a statistics step's)."""
    level, stats = args.count_child[0], args.count_child[1] == "1"
    found: list[actune.CompressionStats] = []
    step = make_step(args, found)
    for _ in range(5):
        step(level, True)
    found.clear()
    _callgrind("--instr=on")
    for _ in range(args.steps):
        step(level, stats)
    _callgrind("--dump=steps")
    step(level, True)
    print(found[-1].packed)


def counted(args: argparse.Namespace) -> None:
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        sys.exit("--instructions needs Valgrind (valgrind and callgrind_control on PATH)")
    env = {**os.environ, "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1",
           "NUMBA_NUM_THREADS": "1"}
    counts, packed = {}, 0
    with tempfile.TemporaryDirectory() as tmp:
        for level in ("L0", args.level):
            for stats in ("0", "1"):
                out = Path(tmp) / f"{level}-{stats}"
                done = subprocess.run(
                    ["valgrind", "--tool=callgrind", "-q", "--instr-atstart=no",
                     "--separate-threads=yes", f"--callgrind-out-file={out}.%p",
                     sys.executable, __file__, "--count-child", level, stats,
                     "--steps", str(args.steps), "--batch", str(args.batch),
                     "--model", args.model, "--tokens", str(args.tokens),
                     "--resolution", str(args.resolution), "--threads", "1",
                     "--api", args.api, *(["--compiled"] if args.compiled else []),
                     *(["--real-kernels"] if args.real_kernels else [])],
                    env=env, capture_output=True, text=True, check=True)
                packed = max(packed, int(done.stdout.split()[-1]))
                dump = next(Path(tmp).glob(f"{out.name}.*.1-01"))  # the main thread's
                summary = next(line for line in dump.read_text().splitlines()
                               if line.startswith("summary:"))
                counts[level, stats] = int(summary.split()[1]) / args.steps
    use = (counts[args.level, "0"] - counts["L0", "0"]) / packed
    accounting = (counts[args.level, "1"] - counts["L0", "1"]) / packed
    print(f"{args.model} {_input(args)}, batch {args.batch}, 1 thread, "
          f"{args.steps} steps counted: {packed} tensors packed a step; instructions a step: "
          f"plain {counts['L0', '0'] / 1e6:.2f}M, {args.level} "
          f"{counts[args.level, '0'] / 1e6:.2f}M; per saved tensor {use / 1e3:.1f}k (use: "
          f"{args.level} against plain PyTorch), {accounting / 1e3:.1f}k (accounting: both "
          f"with statistics)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="resnet18")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--resolution", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=8, help="tokens a sequence (llama)")
    parser.add_argument("--level", default="L3")
    parser.add_argument("--api", choices=("compressed", "compress"), default="compressed",
                        help="the level as `with actune.compressed(level)` (uniform widths) "
                             "or as `actune.compress(model, level)` (widths allocated)")
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--threads", type=int, default=0, help="0: torch's default")
    parser.add_argument("--instructions", action="store_true",
                        help="count instructions under Valgrind instead of timing")
    parser.add_argument("--steps", type=int, default=4, help="steps counted (--instructions)")
    parser.add_argument("--real-kernels", action="store_true",
                        help="run the kernels (what a CPU step costs) instead of no-ops")
    parser.add_argument("--compiled", action="store_true",
                        help="both models under torch.compile (Inductor)")
    parser.add_argument("--floor", action="store_true",
                        help="time an empty function mode and identity hooks against --level")
    parser.add_argument("--count-child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.count_child:
        counted_child(args)
    elif args.instructions:
        counted(args)
    elif args.floor:
        floor(args)
    else:
        timed(args)


if __name__ == "__main__":
    main()
