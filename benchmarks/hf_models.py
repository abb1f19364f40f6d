"""Hugging Face transformers per level: saved activations, max batch and step speed.

(Not named transformers.py: run as a script, that file would shadow the package it imports.)

Models are built from configs with random weights (nothing is downloaded), run as a Hugging
Face training loop runs them: ``model(input_ids=..., labels=...)``, the model's own loss,
default attention (SDPA) unless eager is asked for, AdamW.

1. **small configs, real tensors** (4 layers, 256 wide, vocabulary 8,000, batch 4 x 128
   tokens; GPT-2 and Llama with 2 key-value heads, SDPA and eager attention): heap growth
   across a forward pass whose graph is kept (live tensors at its end, parameters and
   gradients apart, after a warm-up step), from torch's MemTracker, not from actune's own
   statistics; the ratio L0 / level.
2. **full configs, estimated** (FakeTensorMode, no arithmetic): GPT-2 small (``GPT2Config()``)
   at 512 tokens and a Llama of about 1B parameters' shape at 1,024 tokens
   (docs/examples/hf_gpt2.py, hf_llama.py): activation bytes per level at batch 1, and
   ``maxbatch`` under 16 GiB per level, as ``actune maxbatch FILE --budget 16GiB`` answers.
3. **speed**: samples/s of the small GPT-2 at L3 against L0, real CPU steps, alternated.
4. **families** (``--sections families``): the heap growth of section 1 for one small config
   of each family actune has rules for (GPT-2, Llama, Qwen2, BERT, Bloom, T5 with its learned
   relative position bias; SDPA where the family has it), under ``compressed(level)`` and
   under ``compress(model, level)``, against the target L0/L3 >= 10x.

    python benchmarks/hf_models.py [--sections small,full,speed,families] [--skip-maxbatch]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker

import actune
from actune.levels import parse_levels
from actune.memory.budget import Budget
from actune.tune import run
from actune.tune.workload import load

try:
    import transformers
except ImportError as err:
    raise SystemExit("needs Hugging Face transformers: pip install 'actune[hf]'") from err

MiB = 2**20
EXAMPLES = Path(__file__).resolve().parents[1] / "docs" / "examples"
LEVELS = ("L0", "L2", "L3")


def small(kind: str, attention: str):
    """GPT-2 or Llama's small config (:func:`family`) with ``attention`` (sdpa, eager)."""
    return family(kind, attention)


def kept_after_forward(model, ids: torch.Tensor, level: str, form: str = "compressed") -> int:
    """Bytes of live activations at the end of a forward pass (its graph kept), the step run
    inside ``compressed(level)`` or by a model ``compress()`` converted."""
    scope = actune.compressed(level) if form == "compressed" else contextlib.nullcontext()
    with scope:
        model(input_ids=ids, labels=ids).loss.backward()  # warm-up: lazily made state
    tracker = MemTracker()
    with tracker:
        with actune.compressed(level) if form == "compressed" else contextlib.nullcontext():
            loss = model(input_ids=ids, labels=ids).loss
        snap = tracker.get_tracker_snapshot("current")
    loss.backward()
    parts = next(iter(snap.values()))
    return sum(v for k, v in parts.items() if str(k).endswith(("ACT", "TEMP", "OTH")))


def section_small(console: Console) -> None:
    table = Table(title="small configs (4 layers, 256 wide, vocab 8,000, batch 4 x 128): "
                        "activations live at the end of forward (MemTracker)")
    for col in ("model", "attention", *(f"{lv} MiB" for lv in LEVELS), "L0/L2", "L0/L3"):
        table.add_column(col, justify="right")
    ids = torch.randint(0, 8000, (4, 128), generator=torch.Generator().manual_seed(0))
    for kind in ("gpt2", "llama"):
        for attention in ("sdpa", "eager"):
            model = small(kind, attention)
            kept = {lv: kept_after_forward(model, ids, lv) for lv in LEVELS}
            table.add_row(kind, attention, *(f"{kept[lv] / MiB:.1f}" for lv in LEVELS),
                          f"{kept['L0'] / kept['L2']:.1f}x", f"{kept['L0'] / kept['L3']:.1f}x")
    console.print(table)


def family(kind: str, attention: str | None = None):
    """One small config of a family (4 layers or 2+2, 256 wide, vocabulary 8,000), with
    ``attention`` if given (else the family's default)."""
    torch.manual_seed(0)
    t = transformers
    common = {"vocab_size": 8000, "pad_token_id": 0}
    causal = {**common, "bos_token_id": 0, "eos_token_id": 0}
    configs = {
        "gpt2": (t.GPT2Config(n_layer=4, n_embd=256, n_head=4, n_positions=128,
                              bos_token_id=0, eos_token_id=0, vocab_size=8000),
                 t.GPT2LMHeadModel),
        "llama": (t.LlamaConfig(num_hidden_layers=4, hidden_size=256, intermediate_size=688,
                                num_attention_heads=4, num_key_value_heads=2, **causal),
                  t.LlamaForCausalLM),
        "qwen2": (t.Qwen2Config(num_hidden_layers=4, hidden_size=256, intermediate_size=688,
                                num_attention_heads=4, num_key_value_heads=2, **causal),
                  t.Qwen2ForCausalLM),
        "bert": (t.BertConfig(num_hidden_layers=4, hidden_size=256, intermediate_size=1024,
                              num_attention_heads=4, **common), t.BertForMaskedLM),
        "bloom": (t.BloomConfig(n_layer=4, hidden_size=256, n_head=4, **common),
                  t.BloomForCausalLM),
        "t5": (t.T5Config(d_model=256, d_kv=64, d_ff=1024, num_layers=2, num_decoder_layers=2,
                          num_heads=4, decoder_start_token_id=0, **common),
               t.T5ForConditionalGeneration),
    }
    config, cls = configs[kind]
    if attention is not None:
        config._attn_implementation = attention
    return cls(config)


FAMILIES = ("gpt2", "llama", "qwen2", "bert", "bloom", "t5")


def section_families(console: Console) -> None:
    table = Table(title="every family, small configs (4 layers or 2+2, 256 wide, vocabulary "
                        "8,000, batch 4 x 128): activations live at the end of forward")
    for col in ("family", "L0 MiB", "compressed() L3", "L0/L3", "compress() L3", "L0/L3"):
        table.add_column(col, justify="right")
    ids = torch.randint(1, 8000, (4, 128), generator=torch.Generator().manual_seed(0))
    for kind in FAMILIES:
        l0 = kept_after_forward(family(kind), ids, "L0")
        inside = kept_after_forward(family(kind), ids, "L3")
        converted = kept_after_forward(actune.compress(family(kind), "L3"), ids, "L3",
                                       form="compress")
        table.add_row(kind, f"{l0 / MiB:.1f}", f"{inside / MiB:.2f}", f"{l0 / inside:.1f}x",
                      f"{converted / MiB:.2f}", f"{l0 / converted:.1f}x")
    console.print(table)


def estimated_saved(path: Path, level: str, batch: int):
    """(activation bytes kept for backward, the step's statistics) under FakeTensorMode."""
    wl = load(path)
    with FakeTensorMode(), torch.device("cpu"):
        model = wl.model()
        inputs, targets = wl.make_batch(batch)
        held = []  # (at L0 the statistics count what PyTorch keeps)
        with actune.compressed(level, stats=held.append):
            loss = wl.step_loss(model, inputs, targets)
        loss.backward()
    st = held[0]
    return (st.saved_bytes if level == "L0" else st.kept_bytes), st


def section_full(console: Console, maxbatch: bool) -> None:
    for name in ("hf_gpt2", "hf_llama"):
        path = EXAMPLES / f"{name}.py"
        t0 = time.perf_counter()
        saved = {lv: estimated_saved(path, lv, 1) for lv in LEVELS}
        table = Table(title=f"{name} (docs/examples), batch 1, estimated: saved activations "
                            f"({time.perf_counter() - t0:.0f} s)")
        for col in ("level", "saved MiB", "L0/level", "kept exact"):
            table.add_column(col, justify="right")
        for lv, (nbytes, st) in saved.items():
            table.add_row(lv, f"{nbytes / MiB:,.1f}", f"{saved['L0'][0] / nbytes:.1f}x",
                          st.describe_exact() if lv != "L0" else "-")
        console.print(table)
        if maxbatch:
            t0 = time.perf_counter()
            settings = run.Settings(Budget(16 * 2**30, "16 GiB (benchmark)"))
            report = run.maxbatch(load(path), parse_levels("L0,L2,L3,L4"), settings)
            table = Table(title=f"{name}: maxbatch --budget 16GiB --mode estimate "
                                f"({time.perf_counter() - t0:.0f} s)")
            for col in ("level", "max batch", "vs L0", "peak at"):
                table.add_column(col, justify="right")
            for r in report.levels:
                table.add_row(r.level, str(r.value), f"{r.ratio:.2f}x" if r.ratio else "-",
                              r.peak_at)
            console.print(table)


def section_speed(console: Console, steps: int) -> None:
    ids = torch.randint(0, 8000, (4, 128), generator=torch.Generator().manual_seed(0))
    states = {}
    for lv in ("L0", "L3"):
        model = small("gpt2", "sdpa")
        states[lv] = (model, torch.optim.AdamW(model.parameters(), lr=1e-4))

    def step(lv: str) -> float:
        model, opt = states[lv]
        t0 = time.perf_counter()
        with actune.compressed(lv):
            loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return time.perf_counter() - t0

    for lv in states:  # warm-up (kernels compile, allocator settles)
        step(lv), step(lv)
    times: dict[str, list[float]] = {lv: [] for lv in states}
    for _ in range(steps):
        for lv in states:
            times[lv].append(step(lv))
    sps = {lv: 4 / statistics.median(t) for lv, t in times.items()}
    table = Table(title=f"small GPT-2 (SDPA), batch 4 x 128, CPU, median of {steps} "
                        f"alternated steps")
    for col in ("level", "samples/s", "vs L0"):
        table.add_column(col, justify="right")
    for lv, v in sps.items():
        table.add_row(lv, f"{v:.1f}", f"{v / sps['L0']:.2f}x")
    console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-maxbatch", action="store_true")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--sections", default="small,full,speed")
    args = parser.parse_args()
    console = Console(width=120)
    sections = args.sections.split(",")
    with contextlib.suppress(KeyboardInterrupt):
        if "small" in sections:
            section_small(console)
        if "full" in sections:
            section_full(console, not args.skip_maxbatch)
        if "speed" in sections:
            section_speed(console, args.steps)
        if "families" in sections:
            section_families(console)


if __name__ == "__main__":
    main()
