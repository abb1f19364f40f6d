"""Compressed training under torch.compile on a device: compiled L0 against compiled L3.

First the compiled pack alone (2-bit, groups of 256) on a 64M-element float32 tensor
against torch clone (elements a second); then for GPT-2 small (``GPT2Config()`` shape,
``--layers`` layers, batch 4 x 512) and ResNet-50 (batch 64, 224x224): samples/s of compiled
steps (median of alternated rounds) and each step's ``max_memory_allocated``, a line per
model as it finishes. Part of scripts/gpu_check.sh; on the CPU (``--device cpu``) it runs
small sizes as a check (``--models none``: the pack alone).

    python scripts/gpu_compile.py [--device cuda] [--rounds 5] [--models gpt2,resnet50]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

import actune
from actune.apps import zoo
from actune.traced.pack import pack

MIB = 2**20


def _models(device: str, small: bool, layers: int, names: list[str]):
    if "gpt2" in names:
        try:
            import transformers
        except ImportError:  # the transformers extra is optional on the device
            print("GPT-2: transformers is not installed; skipped")
        else:
            tokens, batch = (64, 2) if small else (512, 4)
            config = transformers.GPT2Config(n_layer=1 if small else layers, use_cache=False)
            yield (f"GPT-2 {config.n_layer} layers, {batch} x {tokens} tokens",
                   lambda: _loss_named(transformers.GPT2LMHeadModel(config)),
                   lambda: (torch.randint(0, config.vocab_size, (batch, tokens),
                                          device=device), None), batch)
    if "resnet50" in names:
        res, batch = (32, 8) if small else (224, 64)
        yield (f"ResNet-50 {res}x{res}, batch {batch}",
               lambda: zoo.resnet(50, num_classes=1000),
               lambda: (torch.randn(batch, 3, res, res, device=device),
                        torch.randint(0, 1000, (batch,), device=device)), batch)


def _loss_named(model):
    """The loss GPT2LMHeadModel falls back to, named as compress() names it for L3: unnamed,
    its warning on every call breaks compiled L0's graph between the logits and the loss."""
    model.loss_type = "ForCausalLM"
    return model


def _step(model, opt, inputs, targets):
    if targets is None:  # a language model: its own loss on the ids
        loss = model(input_ids=inputs, labels=inputs).loss
    else:
        loss = torch.nn.functional.cross_entropy(model(inputs), targets)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def compare(device: str, rounds: int, small: bool, layers: int, names: list[str]) -> None:
    cuda = device == "cuda"
    for title, build, batch_of, batch in _models(device, small, layers, names):
        runs = {}
        for level in ("L0", "L3"):
            torch.manual_seed(0)
            model = build().to(device)
            if level != "L0":
                actune.compress(model, level)
            model.compile()
            opt = torch.optim.SGD(model.parameters(), lr=1e-3)
            inputs, targets = batch_of()
            for _ in range(2):  # compile, then settle
                _step(model, opt, inputs, targets)
            runs[level] = (model, opt, inputs, targets)
        times = {lv: [] for lv in runs}
        peaks = {}
        for _ in range(rounds):
            for lv, (model, opt, inputs, targets) in runs.items():
                if cuda:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                t = time.perf_counter()
                _step(model, opt, inputs, targets)
                if cuda:
                    torch.cuda.synchronize()
                    peaks[lv] = torch.cuda.max_memory_allocated()
                times[lv].append(time.perf_counter() - t)
        sps = {lv: batch / statistics.median(t) for lv, t in times.items()}
        line = f"{title}: compiled L0 {sps['L0']:,.1f} samples/s, compiled L3 {sps['L3']:,.1f}"
        line += f" ({sps['L3'] / sps['L0']:.2f}x)"
        if peaks:
            line += (f"; max_memory_allocated L0 {peaks['L0'] / MIB:,.0f} MiB, L3 "
                     f"{peaks['L3'] / MIB:,.0f} MiB ({peaks['L3'] / peaks['L0']:.2f}x)")
        print(line, flush=True)


def pack_speed(device: str, numel: int) -> None:
    x = torch.randn(numel, device=device)
    fn = torch.compile(lambda t: pack(t, 2))

    def timed(f, reps=20):
        f()
        f()
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(reps):
            f()
        if device == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - t) / reps

    clone = timed(lambda: x.clone())
    packed = timed(lambda: fn(x))
    print(f"compiled 2-bit pack of {numel:,} float32: {numel / packed / 1e9:.1f} Gelem/s = "
          f"{clone / packed:.2f}x clone's element rate ({numel / clone / 1e9:.1f} Gelem/s)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--models", default="gpt2,resnet50", help="gpt2, resnet50, or none")
    args = ap.parse_args()
    small = args.device != "cuda"
    pack_speed(args.device, (1 << 16) if small else (64 << 20))
    compare(args.device, args.rounds, small, args.layers, args.models.split(","))
    return 0


if __name__ == "__main__":
    sys.exit(main())
