"""Compressed training under torch.compile: eager and compiled, L0 and L3, side by side.

For each model, the highest of three steps' allocator-level peaks (every CPU allocation and
free the profiler sees, compiled kernels' buffers included, summed in time order: the
high-water mark during forward and backward) and the median step time of interleaved rounds,
with Dynamo's graph breaks and graphs under L3. Peaks twice: after ``zero_grad()``
(gradients set to None, what optimizers and trainers do) and into gradients that exist
(accumulation's later micro-batches; a compiled backward returns every weight gradient at
its end, eager adds each as it is made). Ratios are within this run:

    python benchmarks/compile.py [--rounds 5] [--threads 2] [--fused-packs] [--channels-last]
                                 [--models resnet,llama]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch
import torch._dynamo
from torch import nn
from torch._dynamo.utils import counters

import actune
from actune import tunables
from actune.apps import zoo
from actune.memory.heap import allocation_peak


def mlp():
    blocks = [nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 512),
                            nn.LayerNorm(512)) for _ in range(4)]
    return nn.Sequential(*blocks), torch.randn(2048, 512)


def transformer():
    model = zoo.SmallTransformer(vocab=1000, dim=128, heads=4, layers=2, seq_len=128,
                                 dropout=0.0)
    return model, torch.randint(0, 1000, (16, 128))


def resnet18():
    model = zoo.resnet(18, num_classes=10)
    return model, torch.randn(64, 3, 32, 32)


def hugging_face(kind: str):
    def make():
        from hf_models import small  # the small configs of benchmarks/hf_models.py
        model = small(kind, "sdpa")
        model.config.use_cache = False
        # the loss GPT2LMHeadModel falls back to, named as compress() does for L3: its
        # warning otherwise breaks compiled L0's graph between the logits and the loss
        model.loss_type = "ForCausalLM"
        ids = torch.randint(0, 8000, (4, 128), generator=torch.Generator().manual_seed(0))
        return _LanguageModel(model), ids
    return make


class _LanguageModel(nn.Module):
    """A causal LM whose call on token ids returns its loss (on the ids as labels)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, labels=ids).loss


MODELS = {"MLP (4 x 512-2048-512, batch 2048)": mlp,
          "transformer (2 x 128 wide, 16 x 128 tokens)": transformer,
          "ResNet-18 (32 x 32, batch 64)": resnet18,
          "Hugging Face GPT-2 (4 x 256 wide, 4 x 128 tokens, SDPA)": hugging_face("gpt2"),
          "Hugging Face Llama (4 x 256 wide, 4 x 128 tokens, SDPA)": hugging_face("llama")}


def peak(fn, steps: int = 3) -> float:
    """The highest of ``steps`` consecutive steps' peaks (MiB): a step that gathers the bit
    allocator's statistics, and the one after, hold more than the rest (docs/autoprec.md)."""
    best = 0
    for _ in range(steps):
        gc.collect()  # (what a model's reference cycles hold is freed before, not during)
        best = max(best, allocation_peak(fn))
    return best / 2**20


def variant(make, compiled: bool, level: str, channels_last: bool = False):
    torch.manual_seed(0)
    model, x = make()
    if channels_last and x.dim() == 4:  # (a convolutional model: weights and input NHWC)
        model = model.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    if level != "L0":
        actune.compress(model, level)
    run = torch.compile(model) if compiled else model

    def step(set_to_none: bool = True):
        model.zero_grad(set_to_none=set_to_none)
        out = run(x)
        (out * torch.ones_like(out)).sum().backward()
    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--no-horizontal-fusion", action="store_true",
                        help="Inductor's cpp.max_horizontal_fusion_size = 1 (for every "
                             "compiled variant)")
    parser.add_argument("--no-layout-optimization", action="store_true",
                        help="Inductor's layout_optimization = False (for every compiled "
                             "variant): no channels-last copies of convolutions' weights and "
                             "activations")
    parser.add_argument("--channels-last", action="store_true",
                        help="convolutional models and their inputs in channels-last memory "
                             "format (the layout Inductor's layout optimization copies them "
                             "to otherwise), eager and compiled alike")
    parser.add_argument("--fused-packs", action="store_true",
                        help="pack with torch ops Inductor fuses (a GPU's form) instead of "
                             "the Numba kernels as one op each (the CPU's default)")
    parser.add_argument("--models", default=None,
                        help="comma-separated words picking models by title (default: all)")
    args = parser.parse_args()
    chosen = {t: m for t, m in MODELS.items() if args.models is None
              or any(w.lower() in t.lower() for w in args.models.split(","))}
    if args.threads:
        torch.set_num_threads(args.threads)
    import torch._inductor.config as inductor_config
    if args.no_horizontal_fusion:
        inductor_config.cpp.max_horizontal_fusion_size = 1
    if args.no_layout_optimization:
        inductor_config.layout_optimization = False
    if args.fused_packs:
        tunables.GRAPH_OPS_ON_CPU = False
    for title, make in chosen.items():
        steps, breaks = {}, {}
        for compiled in (False, True):
            for level in ("L0", "L3"):
                torch._dynamo.reset()
                counters.clear()
                step = variant(make, compiled, level, args.channels_last)
                for _ in range(2):
                    step()
                key = ("compiled" if compiled else "eager", level)
                steps[key] = step
                breaks[key] = (sum(counters["graph_break"].values()),
                               counters["stats"].get("unique_graphs", 0))
        peaks = {k: peak(s) for k, s in steps.items()}
        kept = {k: peak(lambda s=s: s(False)) for k, s in steps.items()}
        times = {k: [] for k in steps}
        for _ in range(args.rounds):
            for k, s in steps.items():
                t = time.perf_counter()
                s()
                times[k].append(time.perf_counter() - t)
        print(f"{title}")
        for k in steps:
            print(f"  {k[0]:8s} {k[1]}: peak {peaks[k]:7.1f} MiB ({kept[k]:7.1f} into "
                  f"existing gradients), "
                  f"{statistics.median(times[k]) * 1e3:7.1f} ms/step, graph breaks "
                  f"{breaks[k][0]}, graphs {breaks[k][1]}")
        c3, c0, e3 = ("compiled", "L3"), ("compiled", "L0"), ("eager", "L3")
        speed = statistics.median(times[c0]) / statistics.median(times[c3])
        print(f"  compiled L3 peak / eager L3 {peaks[c3] / peaks[e3]:.2f}x "
              f"({kept[c3] / kept[e3]:.2f}x), / compiled L0 {peaks[c3] / peaks[c0]:.2f}x "
              f"({kept[c3] / kept[c0]:.2f}x); compiled L3 speed / compiled L0 {speed:.2f}x")


if __name__ == "__main__":
    main()
