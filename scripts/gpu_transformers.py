"""Attention's rule on every SDPA backend of a device, and a Hugging Face GPT-2 step per level.

For each backend the device's build offers (CUDA: math, flash, memory-efficient, cuDNN; CPU:
math, flash), in float32 and bfloat16: the gradients of q, k and v through
``F.scaled_dot_product_attention`` (causal, with a boolean mask where the backend takes one,
and with a learned bias that requires grad, T5's) at 8 bits against PyTorch's exact ones, and
whether anything large stayed exact. Then
GPT-2 (``GPT2Config()`` shape, ``--layers`` layers) at batch ``--batch`` x ``--tokens``: samples/s
and saved bytes at L0 and L3, alternated steps.

    python scripts/gpu_transformers.py [--device cuda] [--layers 12] [--batch 8]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F  # noqa: N812
from torch.nn.attention import SDPBackend, sdpa_kernel

import actune
from actune.levels import Level

BACKENDS = {"cuda": ("MATH", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION"),
            "cpu": ("MATH", "FLASH_ATTENTION")}


def backends(device: str, dtype: torch.dtype, seq: int) -> list[str]:
    lines = []
    gen = torch.Generator(device).manual_seed(0)
    shape = (2, 8, seq, 64)
    q, k, v = (torch.randn(shape, device=device, dtype=dtype, generator=gen).requires_grad_()
               for _ in range(3))
    mask = torch.rand(seq, seq, device=device, generator=gen) > 0.2
    # a learned relative position bias, built per call as Hugging Face's T5 does under SDPA
    bias = (torch.randn(1, 8, seq, seq, device=device, dtype=dtype, generator=gen)
            .requires_grad_())
    causal = torch.ones(seq, seq, device=device, dtype=torch.bool).tril()
    eight = Level("u8-all", matmul_bits=8, other_bits=8, masks=True, nonlinear_bits=8)
    cases = {"causal": lambda: {"is_causal": True}, "mask": lambda: {"attn_mask": mask},
             "learned bias": lambda: {"attn_mask": torch.where(
                 causal, bias.expand(2, -1, -1, -1), torch.finfo(dtype).min)}}
    for name in BACKENDS[device]:
        for kind, options in cases.items():
            label = f"{name} {str(dtype).split('.')[-1]} {kind}"
            inputs = (q, k, v, bias) if kind == "learned bias" else (q, k, v)
            try:
                with sdpa_kernel(getattr(SDPBackend, name)):
                    out = F.scaled_dot_product_attention(q * 1, k * 1, v * 1, **options())
                    exact = torch.autograd.grad(out.float().square().sum(), inputs)
                    st = []
                    with actune.compressed(eight, stats=st.append):
                        out = F.scaled_dot_product_attention(q * 1, k * 1, v * 1, **options())
                    got = torch.autograd.grad(out.float().square().sum(), inputs)
            except RuntimeError as err:  # the backend does not take these inputs
                lines.append(f"{label}: not available ({str(err).splitlines()[0][:80]})")
                continue
            errs = [((g - e).float().norm() / e.float().norm()).item()
                    for g, e in zip(got, exact, strict=True)]
            extra = f" bias {errs[3]:.4f}" if len(errs) > 3 else ""
            lines.append(f"{label}: relative error q {errs[0]:.4f} k {errs[1]:.4f} "
                         f"v {errs[2]:.4f}{extra}; kept exact {st[0].exact or 'nothing'}; "
                         f"saved {st[0].saved_bytes / 2**20:.1f} MiB -> "
                         f"{st[0].kept_bytes / 2**20:.2f} MiB")
    return lines


def gpt2_steps(device: str, layers: int, batch: int, steps: int, tokens: int) -> list[str]:
    from transformers import GPT2Config, GPT2LMHeadModel

    ids = torch.randint(0, 50257, (batch, tokens), device=device)
    states = {}
    for level in ("L0", "L3"):
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(n_layer=layers)).to(device)
        states[level] = (model, torch.optim.AdamW(model.parameters(), lr=1e-4), [])

    def step(level: str) -> float:
        model, opt, stats = states[level]
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with actune.compressed(level, stats=stats.append):
            loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    for level in states:
        step(level), step(level)
    times: dict[str, list[float]] = {level: [] for level in states}
    for _ in range(steps):
        for level in states:
            times[level].append(step(level))
    base = batch / statistics.median(times["L0"])
    lines = []
    for level, t in times.items():
        sps, st = batch / statistics.median(t), states[level][2][-1]
        lines.append(f"GPT-2 {layers} layers, batch {batch} x {tokens}, {level}: {sps:.1f} "
                     f"samples/s ({sps / base:.2f}x L0), saved {st.saved_bytes / 2**20:,.0f} "
                     f"MiB, kept {st.kept_bytes / 2**20:,.0f} MiB")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seq", type=int, default=256, help="attention's sequence length")
    parser.add_argument("--tokens", type=int, default=512, help="GPT-2's sequence length")
    args = parser.parse_args()
    for dtype in (torch.float32, torch.bfloat16):
        for line in backends(args.device, dtype, args.seq):
            print(line, flush=True)
    for line in gpt2_steps(args.device, args.layers, args.batch, args.steps, args.tokens):
        print(line, flush=True)


if __name__ == "__main__":
    main()
