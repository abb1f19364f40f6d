"""Memory a CUDA op allocates inside, which no fake kernel does: one formula per op, each
with its source and whether it is derived from that source or fitted.

Each formula gets the op's arguments as the estimate's fake step ran them (on the CPU) and
returns the bytes the op holds on a GPU while it runs, beside its inputs and outputs. The
estimate allocates them before the op's outputs and frees them after. Known and not
modelled (docs/tuning.md): cuDNN's forward workspaces (no measurement to bound them yet), its
batch norm reserve space (a CPU trace runs the native kernel), ``cudnn.benchmark``'s trials.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

HALF = (torch.float16, torch.bfloat16)


def _nbytes(t) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _up(x: int, m: int) -> int:
    return -(-x // m) * m


@dataclass(frozen=True)
class Temporary:
    """How many bytes an op holds inside on a GPU, and why we believe it."""

    formula: Callable[[tuple], int]
    source: str
    kind: str  # "derived" (from the source's code) or "fitted" (to a measurement)


#: The cuDNN convolution backward's workspace, as a multiple of its largest operand. cuDNN's
#: heuristics pick the algorithm (and its workspace) at run time, so only a bound is known:
#: fitted to the project's one H200 run (ResNet-50, batch 64, 224x224, L3: 313 MiB of the
#: measured peak in no tracked tensor, beyond two 32 MiB cuBLAS workspaces, at the stem's
#: backward, whose output gradient is 196 MiB).
CONV_BACKWARD_WORKSPACE = 1.6


def _conv_backward(args: tuple) -> int:
    grad_out, inp = args[0], args[1]
    return int(CONV_BACKWARD_WORKSPACE * max(_nbytes(grad_out), _nbytes(inp)))


def _attention_backward(args: tuple) -> int:
    """The fused attention backward on a GPU, by the dtype it runs in: flash attention's
    (fp16/bf16) ``softmax_d`` (B, H, Tq rounded to 128) and ``dq_accum`` (B, Tq rounded,
    H, D rounded to 32) in float32, and for grouped-query attention ``dk_expanded`` and
    ``dv_expanded`` (B, Tk, H, D) in q's dtype; memory-efficient attention's (float32)
    ``delta`` (B, H, Tq) in float32."""
    q, k = args[1], args[2]  # (grad_out, query, key, value, ...), layout (B, H, T, D)
    batch, heads, tq, dim = q.shape[0], q.shape[1], q.shape[-2], q.shape[-1]
    if q.dtype not in HALF:
        return 4 * batch * heads * tq
    tq_r = _up(tq, 128)
    total = 4 * batch * heads * tq_r + 4 * batch * tq_r * heads * _up(dim, 32)
    if k.shape[1] != heads:  # grouped-query attention
        total += 2 * batch * k.shape[-2] * heads * dim * q.element_size()
    return total


_FLASH = ("aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp (mha_bwd) and "
          "mem_eff_attention's backward (delta)")

#: op overload name (as ``func.name()`` gives it) -> what it holds inside on a GPU
TEMPORARIES: dict[str, Temporary] = {
    "aten::convolution_backward": Temporary(
        _conv_backward, "cuDNN heuristic-mode workspace; CONV_BACKWARD_WORKSPACE", "fitted"),
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward": Temporary(
        _attention_backward, _FLASH, "derived"),
    "aten::_scaled_dot_product_flash_attention_backward": Temporary(
        _attention_backward, _FLASH, "derived"),
    "aten::_scaled_dot_product_efficient_attention_backward": Temporary(
        _attention_backward, _FLASH, "derived"),
}

def temporary_bytes(func, args: tuple) -> int:
    """The bytes ``func`` holds inside on a GPU (0 for ops with no entry)."""
    entry = TEMPORARIES.get(func.name()) if hasattr(func, "name") else None
    return entry.formula(args) if entry is not None else 0
