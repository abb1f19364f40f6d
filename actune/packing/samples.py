"""Per-sample widths: the samples of one tensor (dim 0) packed with different bits."""

from __future__ import annotations

import math

import torch

from actune.packing.formats import PackedRows, PackedSamples
from actune.packing.kernels import KERNEL_DTYPES, draw_seed, numpy_view, plain, storage_order
from actune.packing.tensors import dequantize, quantize
from actune_kernels import layout

__all__ = ["dequantize_samples", "quantize_samples", "row_norms"]


def row_norms(rows: torch.Tensor) -> torch.Tensor:
    """Float32 L2 norm of each row of a 2-D tensor (accumulated in float32 for half types,
    in the tensor's own precision for float64)."""
    if rows.dtype == torch.float64:
        return torch.linalg.vector_norm(rows, dim=1).float()
    return torch.linalg.vector_norm(rows, dim=1, dtype=torch.float32)


def quantize_samples(x: torch.Tensor, runs: tuple[tuple[int, int], ...], *,
                     group_size: int = layout.DEFAULT_GROUP_SIZE,
                     zero_code: bool = False,
                     weight: torch.Tensor | None = None) -> PackedSamples | PackedRows:
    """Quantize the samples of ``x`` (dim 0) with different bits. Samples are ranked by their
    norm (times ``weight``, one factor per sample, if given), largest first; ``runs`` =
    ((bits, count), ...) gives the first ``count`` of them ``bits``, the next run the next
    ones, and so on (the counts add up to the batch). All of
    it stays on the device: nothing waits for the ranking. On the CPU, samples made of whole
    groups are packed in place (:class:`PackedRows`); otherwise each run is gathered and
    packed (:class:`PackedSamples`)."""
    n = x.shape[0]
    if sum(k for _, k in runs) != n:
        raise ValueError(f"runs cover {sum(k for _, k in runs)} samples, the tensor has {n}")
    for bits, _ in runs:
        layout.check_bits(bits)
    x = x.detach()
    dense = storage_order(x)
    per_sample = x.numel() // max(n, 1)
    # (a dense tensor whose samples lead its memory is read in its memory order, no copy;
    # its strides are kept to lay the values out again)
    in_memory = (dense is not None and not x.is_contiguous() and n > 1
                 and x.stride(0) == per_sample)
    rows = dense.reshape(n, -1) if in_memory else x.reshape(n, -1)
    key = row_norms(rows)
    if weight is not None:
        key = key * weight.to(key.device, torch.float32)
    order = torch.argsort(key, descending=True)
    in_place = (dense is not None and x.stride(0) == per_sample and per_sample % group_size == 0
                and x.device.type == "cpu" and plain(x) and x.dtype in KERNEL_DTYPES)
    if not in_place:
        parts, at = [], 0
        for bits, k in runs:
            idx = order[at:at + k]
            at += k
            parts.append((idx, quantize(rows.index_select(0, idx), bits,
                                        group_size=group_size, zero_code=zero_code)))
        return PackedSamples(tuple(parts), x.shape, x.dtype,
                             tuple(x.stride()) if in_memory else None)
    from actune_kernels import cpu_rows as kernels

    by_rank = torch.tensor([b for b, k in runs for _ in range(k)], dtype=torch.uint8)
    row_bits = torch.empty(n, dtype=torch.uint8)
    row_bits[order] = by_rank
    sizes = row_bits.to(torch.int64) * (per_sample // 8)
    row_offset = torch.cumsum(sizes, 0) - sizes
    total = sum(b * k for b, k in runs) * (per_sample // 8)
    codes = torch.empty(total, dtype=torch.uint8)
    meta = torch.empty((x.numel() // group_size, 2), dtype=torch.int16)
    kernels.pack_rows(numpy_view(dense.reshape(-1)), numpy_view(codes), numpy_view(meta),
                      row_bits.numpy(), row_offset.numpy(), group_size, draw_seed(), 0, True,
                      zero_code)
    return PackedRows(codes, meta, row_bits, row_offset, group_size, x.shape, x.dtype,
                      tuple(x.stride()), zero_code)


def dequantize_samples(p: PackedSamples | PackedRows) -> torch.Tensor:
    """The tensor ``p`` was made from, up to quantization error, with its strides
    (:class:`PackedSamples` of a row-major tensor: contiguous)."""
    if isinstance(p, PackedRows):
        from actune_kernels import cpu_rows as kernels

        numel = math.prod(p.shape)
        flat = torch.empty(numel, dtype=p.dtype)
        kernels.unpack_rows(numpy_view(p.codes), numpy_view(p.meta), p.row_bits.numpy(),
                            p.row_offset.numpy(), p.group_size, numpy_view(flat), p.zero_code)
        return flat.as_strided(p.shape, p.stride)
    n = p.shape[0]
    out = torch.empty((n, math.prod(p.shape[1:])), dtype=p.dtype, device=p.device)
    for idx, part in p.parts:
        out.index_copy_(0, idx, dequantize(part))
    if p.stride is not None:  # (the rows are in the tensor's memory order)
        return out.view(-1).as_strided(p.shape, p.stride)
    return out.view(p.shape)

