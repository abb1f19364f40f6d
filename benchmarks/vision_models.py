"""Vision models from Hugging Face transformers under compressed(): saved bytes, kept bytes,
what stays exact, and the gradient error at 8 bits.

Models built from configs (random weights, nothing downloaded; dropout 0, so that the
gradients of two runs compare), in training mode, one step
of cross entropy on random labels: MobileNetV2 (ReLU6), LeViT (Hardswish), MobileViT (SiLU,
attention), ConvNeXt (GELU, layer norm), and actune's own MobileNetV3-Small (torchvision's
layout: Hardswish, squeeze-excitation gates through Hardsigmoid). For each: the bytes
autograd would keep, the bytes kept at ``--level`` (L3 by default) and their ratio, what
stayed exact, and the relative error of every parameter gradient at ``u8`` (8 bits
everywhere) against exact, measured in one run. ``--without-pointwise`` removes the rules
added for the pointwise activations (hardswish, hardsigmoid, the generic derivative rule) to
show the same table as before they existed.

``--floor 8,10`` adds a control independent of actune's rules: every floating tensor autograd
saves (parameters aside) rounded stochastically in groups of 64 consecutive values at each
width, written in plain torch ops under ``torch.autograd.graph.saved_tensors_hooks``, with
only the inputs of the piecewise-linear activations kept exact (a rounded input next to a kink
of hardswish or relu6 flips its derivative: a jump of 0.5 or 1 where rounding should move
it by a step). What that costs a model is the floor of per-group rounding at that width:
rules that beat it add no error of their own, and a model far above 1% at 8 bits is sensitive
to any 8-bit rounding of its activations.

    python benchmarks/vision_models.py [--level L3] [--batch 8] [--without-pointwise]
        [--widths u8,u4] [--seeds 3] [--models levit] [--floor 8,10]
"""

from __future__ import annotations

import argparse
import contextlib

import torch
import torch.nn.functional as F  # noqa: N812
from rich.console import Console
from rich.table import Table
from torch import nn

import actune
from actune.apps import zoo

try:
    import transformers
except ImportError as err:
    raise SystemExit("needs Hugging Face transformers: pip install 'actune[hf]'") from err

MIB = 2**20


def _hf(model: nn.Module):
    def loss(pixel_values, labels):
        return model(pixel_values=pixel_values, labels=labels).loss
    return loss


def models(size: int) -> dict[str, tuple[nn.Module, object, int]]:
    """name -> (module, loss function of (pixels, labels), image size)."""
    torch.manual_seed(0)
    out = {}
    m = transformers.MobileNetV2ForImageClassification(transformers.MobileNetV2Config(
        image_size=size, depth_multiplier=0.5, num_labels=10,
        classifier_dropout_prob=0.0))
    out["MobileNetV2 (ReLU6)"] = (m, _hf(m), size)
    m = transformers.LevitForImageClassification(transformers.LevitConfig(
        image_size=size, hidden_sizes=[64, 96, 128], num_attention_heads=[2, 3, 4],
        depths=[2, 2, 2], key_dim=[16, 16, 16], num_labels=10))
    out["LeViT (Hardswish)"] = (m, _hf(m), size)
    m = transformers.MobileViTForImageClassification(transformers.MobileViTConfig(
        image_size=size, hidden_sizes=[48, 64, 80], neck_hidden_sizes=[8, 16, 24, 32, 48, 64,
                                                                        160], num_labels=10,
        hidden_dropout_prob=0.0, classifier_dropout_prob=0.0))
    out["MobileViT (SiLU)"] = (m, _hf(m), size)
    m = transformers.ConvNextForImageClassification(transformers.ConvNextConfig(
        hidden_sizes=[32, 64, 128, 256], depths=[1, 1, 2, 1], num_labels=10))
    out["ConvNeXt (GELU)"] = (m, _hf(m), size)
    m = zoo.MobileNetV3Small(num_classes=10, dropout=0.0)
    out["MobileNetV3-Small (actune.apps.zoo)"] = (m, lambda x, y, m=m: F.cross_entropy(m(x), y),
                                             size)
    return out


def step(module, loss_fn, pixels, labels, scope, seed: int = 1) -> torch.Tensor:
    """The whole gradient of one step run inside ``scope()`` (rounding seed ``seed``)."""
    module.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    with scope():
        loss = loss_fn(pixels, labels)
    loss.backward()
    return torch.cat([p.grad.reshape(-1) for p in module.parameters() if p.grad is not None])


def fixed_batch(module, size: int, batch: int):
    """A step at a fixed random batch, from the module's state now: ``run(scope, seed)``."""
    module.train()
    gen = torch.Generator().manual_seed(2)
    pixels = torch.randn(batch, 3, size, size, generator=gen)
    labels = torch.randint(0, 10, (batch,), generator=gen)
    state = {k: v.clone() for k, v in module.state_dict().items()}

    def run(loss_fn, scope, seed: int = 1) -> torch.Tensor:
        module.load_state_dict(state)  # (batch norm's running statistics move each step)
        return step(module, loss_fn, pixels, labels, scope, seed)

    return run


def measure(module, loss_fn, size: int, batch: int, level: str, widths=("u8",),
            seeds: int = 1) -> dict:
    batch_run = fixed_batch(module, size, batch)

    def run(lv, stats=None, seed=1):
        return batch_run(loss_fn, lambda: actune.compressed(lv, stats=stats), seed)

    exact = run("L0")
    errors = {w: [((run(w, seed=1 + k) - exact).norm() / exact.norm()).item()
                  for k in range(seeds)] for w in widths}
    kept = []
    run(level, kept.append)
    s = kept[0]
    return {"saved": s.saved_bytes, "kept": s.kept_bytes, "ratio": s.ratio,
            "exact": s.describe_exact() if s.exact else "nothing", "errors": errors}


#: Piecewise-linear activations whose input the rounding floor keeps exact (see the docstring).
_KINKED = frozenset({F.hardswish, F.hardsigmoid, F.relu6, F.hardtanh, F.relu, F.leaky_relu,
                     torch.relu, torch.Tensor.relu})


def _round_groups(t: torch.Tensor, bits: int, group: int = 64) -> torch.Tensor:
    """``t`` rounded stochastically onto ``2**bits`` levels between each group's extremes."""
    flat = t.detach().reshape(-1).float()
    n = flat.numel()
    x = torch.cat([flat, flat[-1:].expand(-n % group)]).view(-1, group)
    lo = x.amin(1, keepdim=True)
    step = (x.amax(1, keepdim=True) - lo).clamp_min(1e-30) / (2**bits - 1)
    codes = torch.floor((x - lo) / step + torch.rand_like(x))
    return (lo + codes * step).reshape(-1)[:n].view_as(t).to(t.dtype)


class _CurrentFunction(torch.overrides.TorchFunctionMode):
    """Names the function whose call is running (the floor's hook asks if it is kinked)."""

    def __init__(self) -> None:
        super().__init__()
        self.func = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        outer, self.func = self.func, func
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.func = outer


def rounding_floor(module, loss_fn, size: int, batch: int, bits: int, seeds: int) -> list[float]:
    """The relative gradient error of the per-group rounding floor at ``bits`` (docstring)."""
    run = fixed_batch(module, size, batch)  # (the batch ``measure`` uses)
    current = _CurrentFunction()

    def pack(t: torch.Tensor) -> torch.Tensor:
        if (not t.is_floating_point() or t.numel() < 64 or current.func in _KINKED
                or isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter)):
            return t
        return _round_groups(t, bits)

    def rounded() -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        stack.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t))
        stack.enter_context(current)
        return stack

    exact = run(loss_fn, contextlib.nullcontext)
    return [((run(loss_fn, rounded, 1 + k) - exact).norm() / exact.norm()).item()
            for k in range(seeds)]


def _errors(values: list[float]) -> str:
    mean = sum(values) / len(values)
    if len(values) == 1:
        return f"{mean:.2%}"
    return f"{mean:.2%} ({min(values):.2%}-{max(values):.2%})"


@contextlib.contextmanager
def without_pointwise():
    """The pointwise activations' rules removed, as before they existed."""
    from actune.rules import RULES, pointwise

    names = {"hardsigmoid", "derivative_rule", "prelu", "shrink", "threshold",
             "one_sided_clamp", "rrelu", "softmin", "glu"}
    removed = {f: r for f, r in RULES.items()
               if r.replace is not None and r.replace.__name__ in names}
    for f in removed:
        del RULES[f]
    generic, pointwise._RULE = pointwise._RULE, None
    pointwise._GENERIC.clear()
    try:
        yield
    finally:
        RULES.update(removed)
        pointwise._RULE = generic
        pointwise._GENERIC.clear()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--level", default="L3")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--without-pointwise", action="store_true")
    parser.add_argument("--widths", default="u8",
                        help="uniform levels whose gradient error is measured (u8,u4: their "
                             "ratio is 17x where the error is rounding noise alone)")
    parser.add_argument("--seeds", type=int, default=1, help="rounding seeds per width")
    parser.add_argument("--floor", default="",
                        help="widths of the per-group rounding floor to measure as a control "
                             "(8,10: see the docstring)")
    parser.add_argument("--models", default=None,
                        help="comma-separated words the models' names must contain")
    args = parser.parse_args()
    widths = tuple(args.widths.split(","))
    floors = tuple(int(b) for b in args.floor.split(",") if b)
    table = Table(title=f"{args.level}, batch {args.batch} x 3 x {args.size}^2, training step"
                  + (" (pointwise rules removed)" if args.without_pointwise else ""))
    for col in ("model", "saved MiB", "kept MiB", "ratio",
                *(f"{w} grad error" for w in widths),
                *(f"{b}-bit floor" for b in floors), "kept exact"):
        table.add_column(col, justify="left" if col in ("model", "kept exact") else "right")
    wanted = None if args.models is None else args.models.lower().split(",")
    with without_pointwise() if args.without_pointwise else contextlib.nullcontext():
        for name, (module, loss_fn, size) in models(args.size).items():
            if wanted is not None and not any(w in name.lower() for w in wanted):
                continue
            r = measure(module, loss_fn, size, args.batch, args.level, widths, args.seeds)
            table.add_row(name, f"{r['saved'] / MIB:.1f}", f"{r['kept'] / MIB:.2f}",
                          f"{r['ratio']:.1f}x", *(_errors(r["errors"][w]) for w in widths),
                          *(_errors(rounding_floor(module, loss_fn, size, args.batch, b,
                                                   args.seeds)) for b in floors),
                          r["exact"])
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
