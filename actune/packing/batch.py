"""quantize_many() / dequantize_many(): several tensors through one kernel call.

A kernel call has a fixed cost (on the CPU the call, argument checks and the thread pool; on
CUDA numba's launch) that dominates for small tensors. Here the small tensors of one call are
copied into one flat buffer per device and precision (float64 apart) and packed as segments
of it (:mod:`actune_kernels.cpu_segments`; ``pack_segments`` in
:mod:`actune_kernels.cuda`): each keeps its own bits and zero-code flag, and its bytes are
those :func:`actune.packing.tensors.quantize` gives it alone, at its own place in one random stream.
The packed tensors are views of one codes and one metadata buffer. Fake and traced tensors go
one by one through :func:`quantize`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from actune import tunables
from actune.packing.formats import PackedTensor
from actune.packing.kernels import cuda_launch, draw_seed, numpy_view, plain
from actune.packing.tensors import check_arguments, dequantize, memory_order, quantize
from actune_kernels import layout

__all__ = ["dequantize_many", "quantize_many"]


def _per_tensor(value, n: int, name: str) -> list:
    if isinstance(value, Sequence):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} entries for {n} tensors")
        return list(value)
    return [value] * n


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _batchable(t: torch.Tensor, numel: int, small: int) -> bool:
    return 0 < numel < small and plain(t) and (t.is_cpu or t.device.type == "cuda")


def _table(numels: list[int], widths: list[int], zeros: list[bool], group_size: int,
           device: torch.device) -> tuple[np.ndarray, torch.Tensor]:
    """The segment table (:func:`actune_kernels.cpu_segments.segment_table`) on the host,
    and as a tensor on ``device`` (for CUDA sent from pinned memory without waiting: no
    host-device synchronisation)."""
    from actune_kernels.cpu_segments import segment_table

    host = segment_table(numels, widths, zeros, group_size)
    table = torch.from_numpy(host)
    if device.type == "cuda":
        table = table.pin_memory().to(device, non_blocking=True)
    return host, table


def quantize_many(xs: Sequence[torch.Tensor], bits: int | Sequence[int], *,
                  group_size: int = layout.DEFAULT_GROUP_SIZE, seed: int | None = None,
                  stochastic: bool = True,
                  zero_code: bool | Sequence[bool] = False) -> list[PackedTensor]:
    """:func:`actune.packing.tensors.quantize` of each tensor of ``xs``, small CPU and CUDA ones
    (under
    ``tunables.SMALL_PACK`` elements) in one kernel call per device and working precision (float64;
    everything else as float32), the others in a call each. ``bits`` and ``zero_code`` are
    one value for all or one per tensor; dtypes, shapes and layouts may differ. Each result
    dequantizes (with :func:`dequantize` or :func:`dequantize_many`) to its own
    tensor's shape, dtype and strides. With ``seed``, the call whose first tensor is
    ``xs[i]`` uses ``seed + i``: a large tensor packed alone, say at index 0, gets the bytes of
    ``quantize(xs[0], bits, seed=seed)``."""
    n = len(xs)
    widths = _per_tensor(bits, n, "bits")
    zeros = _per_tensor(zero_code, n, "zero_code")
    for x, b, z in zip(xs, widths, zeros, strict=True):
        check_arguments(x, b, group_size, seed, z)
    out: list[PackedTensor | None] = [None] * n
    batches: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, x in enumerate(xs):
        if _batchable(x, x.numel(), tunables.SMALL_PACK):
            batches.setdefault((x.device, _work_dtype(x.dtype)), []).append(i)
        else:
            out[i] = quantize(x, widths[i], group_size=group_size, seed=_seed(seed, i),
                              stochastic=stochastic, zero_code=zeros[i])
    for (_, work), idx in batches.items():
        if len(idx) == 1:  # nothing to share a call with
            i = idx[0]
            out[i] = quantize(xs[i], widths[i], group_size=group_size, seed=_seed(seed, i),
                              stochastic=stochastic, zero_code=zeros[i])
            continue
        seed_of_call = _seed(seed, idx[0])
        for i, p in zip(idx, _pack_batch([xs[i] for i in idx], [widths[i] for i in idx],
                                         [zeros[i] for i in idx], work, group_size,
                                         draw_seed() if seed_of_call is None else seed_of_call,
                                         stochastic),
                        strict=True):
            out[i] = p
    return out


def _seed(seed: int | None, first: int) -> int | None:
    """The seed of the call whose first tensor is ``xs[first]``: calls draw distinct
    streams."""
    return None if seed is None else (seed + first) % 2**62


def _pack_batch(xs: list[torch.Tensor], widths: list[int], zeros: list[bool],
                work: torch.dtype, group_size: int, seed: int,
                stochastic: bool) -> list[PackedTensor]:
    flats, strides = zip(*(memory_order(x) for x in xs), strict=True)
    device = xs[0].device
    flat = torch.cat([f if f.dtype == work else f.to(work) for f in flats])
    host, table = _table([f.numel() for f in flats], widths, zeros, group_size, device)
    group, codes_at = host[1].tolist(), host[2].tolist()
    codes = torch.empty(codes_at[-1], dtype=torch.uint8, device=device)
    meta = torch.empty((group[-1], 2), dtype=torch.int16, device=device)
    if device.type == "cpu":
        from actune_kernels import cpu_segments

        cpu_segments.pack_segments(flat.numpy(), codes.numpy(), numpy_view(meta), host, group_size,
                                   seed, stochastic)
    else:
        from actune_kernels import cuda as kernels

        cuda_launch(lambda x, c, m, t, stream: kernels.pack_segments(
            x, c, m, t, group_size, seed, stochastic, stream=stream), flat, codes, meta, table)
    return [PackedTensor(codes[codes_at[k]:codes_at[k + 1]], meta[group[k]:group[k + 1]],
                         widths[k], group_size, x.shape, x.dtype, strides[k], zeros[k])
            for k, x in enumerate(xs)]


def dequantize_many(ps: Sequence[PackedTensor]) -> list[torch.Tensor]:
    """:func:`actune.packing.tensors.dequantize` of each packed tensor, small CPU and CUDA ones
    (under
    ``tunables.SMALL_UNPACK`` elements, not in feature-major order) in one kernel call per device,
    group size and precision, the others in a call each. The small ones' results are views of
    one buffer (freed when the last of them is)."""
    out: list[torch.Tensor | None] = [None] * len(ps)
    batches: dict[tuple[torch.device, int, torch.dtype], list[int]] = {}
    for i, p in enumerate(ps):
        if _batchable(p.codes, p.numel(), tunables.SMALL_UNPACK) and not p.by_feature:
            batches.setdefault((p.codes.device, p.group_size, _work_dtype(p.dtype)),
                               []).append(i)
        else:
            out[i] = dequantize(p)
    for (_, group_size, work), idx in batches.items():
        if len(idx) == 1:
            out[idx[0]] = dequantize(ps[idx[0]])
            continue
        for i, t in zip(idx, _unpack_batch([ps[i] for i in idx], work, group_size),
                        strict=True):
            out[i] = t
    return out


def _unpack_batch(ps: list[PackedTensor], work: torch.dtype,
                  group_size: int) -> list[torch.Tensor]:
    widths = [p.bits for p in ps]
    zeros = [p.zero_code for p in ps]
    numels = [p.numel() for p in ps]
    device = ps[0].codes.device
    host, table = _table(numels, widths, zeros, group_size, device)
    start = host[0].tolist()
    codes = torch.cat([p.codes for p in ps])
    meta = torch.cat([p.meta for p in ps])
    flat = torch.empty(start[-1], dtype=work, device=device)
    if device.type == "cpu":
        from actune_kernels import cpu_segments

        cpu_segments.unpack_segments(codes.numpy(), numpy_view(meta), host, group_size,
                                     flat.numpy())
    else:
        from actune_kernels import cuda as kernels

        cuda_launch(lambda c, m, t, o, stream: kernels.unpack_segments(
            c, m, t, group_size, o, stream=stream), codes, meta, table, flat)
    out = []
    for k, p in enumerate(ps):
        t = flat[start[k]:start[k + 1]].as_strided(p.shape, p.stride)
        out.append(t if p.dtype == work else t.to(p.dtype))
    return out
