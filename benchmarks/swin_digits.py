"""Swin V2 trained on scikit-learn's digits: test accuracy per epoch at each level.

The zoo's small Swin V2 (embedding 32, depths 2-2, windows of 4 x 4 patches of 2 x 2 pixels)
on the 1,797 digits upscaled to 3 x 32 x 32 (1,400 to train, the rest to test, a fixed split),
``actune.compress(model, level)`` for every level but L0, AdamW at ``--lr``, batch 64. Prints
the test accuracy after each epoch (the curve) and the final training loss, per level and seed.
Swin V2's cosine attention (``F.normalize``'s outputs multiplied, a learned logit scale, a
softmax over 16 keys) is where L3's rounding noise is largest among the zoo's models
(docs/benchmarks.md, "Many architectures").

    python benchmarks/swin_digits.py [--levels L0,u8,L3] [--seeds 0,1,2] [--lr 1e-3]
        [--epochs 10]
"""

from __future__ import annotations

import argparse
import statistics
import warnings

import torch
import torch.nn.functional as F  # noqa: N812

import actune

try:
    import transformers
    from sklearn.datasets import load_digits
except ImportError as err:
    raise SystemExit("needs transformers and scikit-learn: pip install 'actune[hf,data]'") from err


def digits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32) / 16.0
    x = F.interpolate(x[:, None], size=32, mode="bilinear").repeat(1, 3, 1, 1)
    y = torch.tensor(data.target)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(123))
    train, test = order[:1400], order[1400:]
    return x[train], y[train], x[test], y[test]


def run(level: str, seed: int, lr: float, epochs: int, data) -> tuple[list[float], float]:
    x, y, x_test, y_test = data
    torch.manual_seed(seed)
    model = transformers.Swinv2ForImageClassification(transformers.Swinv2Config(
        image_size=32, patch_size=2, embed_dim=32, depths=[2, 2], num_heads=[2, 4],
        window_size=4, num_labels=10, drop_path_rate=0.0, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0))
    model.train()
    if level != "L0":
        model = actune.compress(model, level)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    curve = []
    for _ in range(epochs):
        order = torch.randperm(len(x))
        for i in range(0, len(order), 64):
            batch = order[i:i + 64]
            loss = model(pixel_values=x[batch], labels=y[batch]).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        model.eval()
        with torch.no_grad():
            logits = model(pixel_values=x_test).logits
        curve.append((logits.argmax(-1) == y_test).float().mean().item())
        model.train()
    return curve, loss.item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", default="L0,u8,L3")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--epochs", type=int, default=10)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    data = digits()
    for level in args.levels.split(","):
        finals = []
        for seed in (int(s) for s in args.seeds.split(",")):
            curve, loss = run(level, seed, args.lr, args.epochs, data)
            finals.append(curve[-1])
            print(f"{level} seed {seed}: test accuracy by epoch "
                  f"{' '.join(f'{a:.1%}' for a in curve)}; final loss {loss:.3f}", flush=True)
        print(f"{level}: mean final accuracy {statistics.mean(finals):.1%}", flush=True)


if __name__ == "__main__":
    main()
