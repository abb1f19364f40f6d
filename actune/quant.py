"""quantize() / dequantize(): the torch-facing API of the packed format.

The byte format and the kernels live in ``actune_kernels`` (no torch there). This module
allocates every buffer with torch, so the caching allocator and torch's memory statistics see
all of it, hands the buffers to the Numba kernels (NumPy views on the CPU, zero-copy
``__cuda_array_interface__`` views on CUDA, launched on torch's current stream), and registers
both steps as ``torch.library`` custom ops with fake (shape-only) implementations, so code that
calls them runs under ``FakeTensorMode`` and passes ``torch.library.opcheck``.
"""

from __future__ import annotations

import functools
import math
import mmap
from dataclasses import dataclass

import numpy as np
import torch
from torch._subclasses.fake_tensor import FakeTensor

from actune_kernels import layout

__all__ = ["PackedCodes", "PackedRows", "PackedSamples", "PackedTensor", "dequantize",
           "dequantize_codes", "dequantize_samples", "group_steps", "pack_codes", "quantize",
           "quantize_samples", "unpack_codes"]

_SEED_RANGE = 2**31 - 1
_KERNEL_DTYPES = (torch.float32, torch.float64)


@dataclass(frozen=True)
class PackedTensor:
    """A tensor quantized to ``bits`` per element, in groups of ``group_size``.

    ``codes`` holds the packed codes, ``meta`` two 16-bit words per group (see
    ``actune_kernels.layout``); ``shape``, ``dtype`` and ``stride`` describe the original tensor.
    In an estimate's simulated offload ``meta`` is None and ``codes`` a fake buffer of every
    byte (one allocation each way instead of two).
    """

    codes: torch.Tensor
    meta: torch.Tensor | None
    bits: int
    group_size: int
    shape: torch.Size
    dtype: torch.dtype
    stride: tuple[int, ...]
    zero_code: bool = False
    by_feature: bool = False

    @property
    def nbytes(self) -> int:
        """Every byte held: codes and metadata."""
        return self.codes.nbytes + (0 if self.meta is None else self.meta.nbytes)

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def bits_per_element(self) -> float:
        """Stored bits per original element, metadata and padding included."""
        return 8 * self.nbytes / max(self.numel(), 1)


# ---------------------------------------------------------------------------------------------
# Kernel dispatch: CPU through NumPy views, CUDA through __cuda_array_interface__.


_new = object.__new__


if hasattr(torch.compiler, "_compile_session_context"):  # torch holds the flag while compiling
    def compiling() -> bool:
        """``torch.compiler.is_compiling()`` in one call: read from the flag torch holds for a
        whole compile session, Dynamo's tracing included (outside TorchScript, the same)."""
        return torch.compiler._is_compiling_flag
else:
    compiling = torch.compiler.is_compiling


def _draw_seed() -> int:
    return int(torch.randint(0, _SEED_RANGE, (), device="cpu").item())


#: numba's handle of each torch CUDA stream a kernel was launched on, by its address (made
#: once: the kernels' launch configurations are cached per stream object).
_STREAMS: dict[int, object] = {}


def _cuda_launch(fn, *tensors, **kw):
    from numba import cuda

    arrays = [cuda.as_cuda_array(t, sync=False) for t in tensors]
    arrays = [a.view(np.uint16) if a.dtype == np.int16 else a for a in arrays]
    address = torch.cuda.current_stream(tensors[0].device).cuda_stream
    stream = _STREAMS.get(address)
    if stream is None:
        stream = _STREAMS[address] = cuda.external_stream(address)
    fn(*arrays, stream=stream, **kw)


@functools.cache
def _cpu_kernels():
    from actune_kernels import cpu

    return cpu


#: The kernels' dtypes as NumPy names them: the CPU kernels take buffers by address (reading a
#: tensor's address costs a tenth of making a NumPy array of it).
_NUMPY_DTYPES = {torch.float32: np.dtype(np.float32), torch.float64: np.dtype(np.float64)}


def _numpy(t: torch.Tensor) -> np.ndarray:
    a = t.detach().numpy()
    return a.view(np.uint16) if a.dtype == np.int16 else a


#: CPU outputs from this size up are mapped fresh by the C library on every call (glibc maps
#: requests above 32 MiB directly and never reuses them), and faulting them in a 4 KiB page at
#: a time bound dequantize to clone's speed; in transparent huge pages (where the system
#: offers them on request) the same output costs a seventh (docs/benchmarks.md).
HUGE_OUTPUT_BYTES = 32 << 20
_HUGE_PAGES = hasattr(mmap, "MADV_HUGEPAGE")


def _empty_cpu(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised 1-D CPU tensor; from ``HUGE_OUTPUT_BYTES`` up, in its own anonymous
    mapping advised to use huge pages (freed with the tensor's storage)."""
    nbytes = numel * dtype.itemsize
    if nbytes < HUGE_OUTPUT_BYTES or not _HUGE_PAGES:
        return torch.empty(numel, dtype=dtype)
    buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buffer.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(buffer, dtype=dtype)


def _pack_impl(x: torch.Tensor, bits: int, group_size: int, seed: int, stochastic: bool,
             zero_code: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack a 1-D tensor (or, called directly, any contiguous one without autograd history);
    ``seed`` < 0 draws one from torch's default generator."""
    n = x.numel()
    on_cpu = x.is_cpu  # (cheaper than x.device, which the common case never needs)
    device = None if on_cpu else x.device
    groups = -(-n // group_size)  # (layout.num_groups and codes_nbytes, inline)
    codes = torch.empty(groups * group_size * bits // 8, dtype=torch.uint8, device=device)
    meta = torch.empty((groups, 2), dtype=torch.int16, device=device)
    if n == 0:
        return codes, meta
    if seed < 0:
        seed = _draw_seed()
    src = x if x.dtype in _KERNEL_DTYPES else x.float()
    if on_cpu:
        src = src.contiguous()  # (itself when it is)
        _cpu_kernels().pack_at(src.data_ptr(), n, _NUMPY_DTYPES[src.dtype], codes.data_ptr(),
                               meta.data_ptr(), bits, group_size, seed, 0, stochastic, zero_code)
    elif device.type == "cuda":
        from actune_kernels import cuda as kernels

        _cuda_launch(lambda a, c, m, stream: kernels.pack(a, c, m, bits, group_size, seed, 0,
                                                           stochastic, zero_code, stream=stream),
                     src.reshape(-1), codes, meta)
    else:
        raise NotImplementedError(f"actune has kernels for CPU and CUDA tensors, not {x.device}")
    return codes, meta


_pack_op = torch.library.custom_op("actune::pack", mutates_args=())(_pack_impl)


@_pack_op.register_fake
def _fake_pack(x, bits, group_size, seed, stochastic, zero_code):
    n = x.numel()
    groups = -(-n // group_size)
    codes = x.new_empty((groups * (group_size * bits // 8),), dtype=torch.uint8)
    meta = x.new_empty((groups, 2), dtype=torch.int16)
    return codes, meta


def _unpack_impl(codes: torch.Tensor, meta: torch.Tensor, bits: int, group_size: int,
               numel: int, dtype: torch.dtype, zero_code: bool) -> torch.Tensor:
    """Dequantize to a 1-D tensor of ``numel`` elements of ``dtype``."""
    work = dtype if dtype in _KERNEL_DTYPES else torch.float32
    on_cpu = codes.is_cpu
    out = (_empty_cpu(numel, work) if on_cpu
           else torch.empty(numel, dtype=work, device=codes.device))
    if numel:
        if on_cpu:
            _unpack_cpu(codes, meta, bits, group_size, out, numel, zero_code)
        elif codes.device.type == "cuda":
            from actune_kernels import cuda as kernels

            _cuda_launch(lambda c, m, o, stream: kernels.unpack(c, m, bits, group_size, o,
                                                                 zero_code, stream=stream),
                         codes, meta, out)
        else:
            raise NotImplementedError(
                f"actune has kernels for CPU and CUDA tensors, not {codes.device}")
    return out if work == dtype else out.to(dtype)


def _unpack_cpu(codes: torch.Tensor, meta: torch.Tensor, bits: int, group_size: int,
                out: torch.Tensor, numel: int, zero_code: bool) -> None:
    """Fill ``out`` (CPU, float32/64, dense in any layout: written in memory order)."""
    codes, meta = codes.contiguous(), meta.contiguous()  # (a packed value built by hand)
    _cpu_kernels().unpack_at(codes.data_ptr(), meta.data_ptr(), bits, group_size,
                             out.data_ptr(), numel, _NUMPY_DTYPES[out.dtype], zero_code)


_unpack_op = torch.library.custom_op("actune::unpack", mutates_args=())(_unpack_impl)


@_unpack_op.register_fake
def _fake_unpack(codes, meta, bits, group_size, numel, dtype, zero_code):
    return codes.new_empty((numel,), dtype=dtype)


# ---------------------------------------------------------------------------------------------
# Public API.


def _plain(t: torch.Tensor) -> bool:
    """Eager, real tensors call the kernels directly (the same function the op registers),
    skipping the dispatcher's overhead; fake tensors and traced code go through the op."""
    return type(t) is torch.Tensor and not compiling()


def _shapes_only(t: torch.Tensor) -> bool:
    """A fake tensor outside tracing (an estimate): only shapes and bytes matter."""
    return isinstance(t, FakeTensor) and not compiling()


def _storage_order(x: torch.Tensor) -> torch.Tensor | None:
    """``x`` permuted so that its memory order is row-major, or None if it is not dense."""
    if x.is_contiguous():
        return x
    order = sorted(range(x.dim()), key=lambda d: (-x.stride(d), -x.size(d)))
    permuted = x.permute(order)
    return permuted if permuted.is_contiguous() else None


def check_arguments(x: torch.Tensor, bits: int, group_size: int, seed: int | None,
                    zero_code: bool) -> None:
    """Raise ``TypeError`` / ``ValueError`` naming what to fix in :func:`quantize`'s
    arguments."""
    layout.check_bits(bits)
    layout.check_group_size(group_size)
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"quantize expects a floating-point tensor, got {type(x).__name__}"
                        + (f" of {x.dtype}" if isinstance(x, torch.Tensor) else ""))
    if seed is not None and not 0 <= seed < 2**62:
        raise ValueError(f"seed must be in [0, 2**62), got {seed}")
    if zero_code and bits < 2:
        raise ValueError("zero_code needs at least 2 bits (code 0 is taken by the zeros)")


def quantize(x: torch.Tensor, bits: int, *, group_size: int = layout.DEFAULT_GROUP_SIZE,
             seed: int | None = None, stochastic: bool = True,
             zero_code: bool = False) -> PackedTensor:
    """Quantize a floating tensor to ``bits`` (1, 2, 4 or 8) per element.

    Groups of ``group_size`` consecutive elements (in memory order) share a 16-bit minimum and
    step. Stochastic rounding (the default) is unbiased: ``E[dequantize(quantize(x))] == x``.
    ``seed`` fixes the rounding; by default it is drawn from torch's default generator, so
    ``torch.manual_seed`` makes runs repeatable. ``stochastic=False`` rounds to nearest.
    Dense layouts (contiguous, channels_last, any permutation) are packed without a copy and
    restored by :func:`dequantize`; other strided tensors are copied first. Groups holding NaN
    or inf dequantize to NaN.

    ``zero_code=True`` (for tensors >= 0, such as ReLU outputs; 2 bits or more) reserves code 0
    for exact zeros: ``dequantize(p) > 0`` is then exactly ``x > 0``, still unbiased.
    """
    check_arguments(x, bits, group_size, seed, zero_code)
    return quantize_checked(x, bits, group_size, -1 if seed is None else seed, stochastic,
                            zero_code)


def quantize_checked(x: torch.Tensor, bits: int, group_size: int, seed: int,
                     stochastic: bool = True, zero_code: bool = False,
                     by_feature: bool = False) -> PackedTensor:
    """:func:`quantize` for a caller that has checked its arguments (the saved-tensor hooks,
    whose level checked its widths): ``seed`` < 0 draws one. ``by_feature``: pack a
    features-last tensor by feature (a group holds one feature's values; on the CPU the
    column layout, elsewhere a feature-major copy: :mod:`actune.quant_columns`)."""
    if by_feature and _columns.feature_order(x) is not None:
        return _columns.quantize_by_feature(x, bits, group_size, seed, stochastic, zero_code)
    if type(x) is torch.Tensor and x.is_contiguous() and not compiling():
        # the common case, with no flat view to make
        codes, meta = _pack_impl(x.detach(), bits, group_size, seed, stochastic, zero_code)
        p = _new(PackedTensor)  # (the frozen dataclass's own __init__ sets each field by a call)
        p.__dict__.update(codes=codes, meta=meta, bits=bits, group_size=group_size,
                          shape=x.shape, dtype=x.dtype, stride=x.stride(), zero_code=zero_code,
                          by_feature=False)
        return p
    if _shapes_only(x) and x.is_contiguous():  # an estimate: no detach, no flat view
        codes, meta = _fake_pack(x, bits, group_size, 0, stochastic, zero_code)
        return PackedTensor(codes, meta, bits, group_size, x.shape, x.dtype, tuple(x.stride()),
                            zero_code)
    flat, stride = memory_order(x)
    pack = _fake_pack if _shapes_only(x) else _pack_impl if _plain(x) else _pack_op
    codes, meta = pack(flat, bits, group_size, seed, stochastic, zero_code)
    return PackedTensor(codes, meta, bits, group_size, x.shape, x.dtype, stride, zero_code)


def memory_order(x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """``x``'s elements as a 1-D tensor in memory order (a view when ``x`` is dense in any
    layout, else a row-major copy) and the strides :func:`dequantize` restores."""
    x = x.detach()
    dense = _storage_order(x)
    if dense is None:  # overlapping or with gaps: pack a row-major copy
        dense = x.contiguous()
        return dense.reshape(-1), tuple(dense.stride())
    return dense.reshape(-1), tuple(x.stride())


def dequantize(p: PackedTensor) -> torch.Tensor:
    """The tensor ``p`` was made from, up to quantization error: same shape, dtype, device and
    memory layout (strides)."""
    if p.by_feature:
        return _columns.dequantize_by_feature(p)
    codes = p.codes
    if type(codes) is torch.Tensor and not compiling():  # the common case
        dtype = p.dtype
        n = p.numel()
        if codes.is_cpu and dtype in _KERNEL_DTYPES and 0 < n * dtype.itemsize < HUGE_OUTPUT_BYTES:
            out = torch.empty_strided(p.shape, p.stride, dtype=dtype)  # written in its layout
            _unpack_cpu(codes, p.meta, p.bits, p.group_size, out, n, p.zero_code)
            return out
        return _unpack_impl(codes, p.meta, p.bits, p.group_size, n, dtype,
                            p.zero_code).as_strided(p.shape, p.stride)
    if _shapes_only(codes):  # an estimate: the output's storage in one operation
        return codes.new_empty_strided(p.shape, p.stride, dtype=p.dtype)
    unpack = _unpack_impl if _plain(codes) else _unpack_op
    flat = unpack(p.codes, p.meta, p.bits, p.group_size, p.numel(), p.dtype, p.zero_code)
    out = flat.as_strided(p.shape, p.stride)
    return out


def dequantize_into(p: PackedTensor, out: torch.Tensor) -> torch.Tensor:
    """:func:`dequantize` written into ``out`` (``p``'s shape and dtype, contiguous), in place
    of a new tensor: on the CPU the kernel fills it directly (no allocation to fault in: half
    the time of dequantize-then-copy for 16 MiB), elsewhere a copy. Returns ``out``."""
    if (p.shape != out.shape or p.dtype != out.dtype or not out.is_contiguous()
            or out.device != p.codes.device):
        raise ValueError(f"dequantize_into needs a contiguous {p.dtype} tensor of shape "
                         f"{tuple(p.shape)} on {p.codes.device}, got {out.dtype} "
                         f"{tuple(out.shape)} on {out.device}")
    if (not p.by_feature and type(p.codes) is torch.Tensor and p.codes.is_cpu
            and p.dtype in _KERNEL_DTYPES and not compiling()
            and p.stride == out.stride()):
        _unpack_cpu(p.codes, p.meta, p.bits, p.group_size, out, out.numel(), p.zero_code)
        return out
    return out.copy_(dequantize(p))


def group_steps(p: PackedTensor) -> torch.Tensor:
    """Each group's step between codes (float32; 0 for groups holding NaN or inf)."""
    word = p.meta[:, 1]
    magnitude = word & 0x7FFF
    half = magnitude.view(torch.float16).float()
    brain = magnitude.view(torch.bfloat16).float()
    steps = torch.where(word < 0, brain, half)  # the sign bit names the grid (see layout)
    return torch.nan_to_num(steps, nan=0.0, posinf=0.0)


@dataclass(frozen=True)
class PackedSamples:
    """A tensor whose samples (along dim 0) were quantized with different bits: ``parts``
    holds, per bit width, the indices of its samples and their packed rows."""

    parts: tuple[tuple[torch.Tensor, PackedTensor], ...]
    shape: torch.Size
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return sum(idx.nbytes + p.nbytes for idx, p in self.parts)

    @property
    def device(self) -> torch.device:
        return self.parts[0][1].device


@dataclass(frozen=True)
class PackedRows:
    """A tensor whose samples (rows along dim 0, whole groups each) were packed with their
    own bits into one buffer: row ``r`` at ``row_bits[r]`` bits from byte ``row_offset[r]``.
    Each row's codes and metadata are those :func:`quantize` gives the whole tensor at that
    width (the CPU kernels' per-row variant: no copies)."""

    codes: torch.Tensor
    meta: torch.Tensor
    row_bits: torch.Tensor
    row_offset: torch.Tensor
    group_size: int
    shape: torch.Size
    dtype: torch.dtype
    stride: tuple[int, ...]
    zero_code: bool = False

    @property
    def nbytes(self) -> int:
        return (self.codes.nbytes + self.meta.nbytes + self.row_bits.nbytes
                + self.row_offset.nbytes)

    @property
    def device(self) -> torch.device:
        return self.codes.device


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
    dense = _storage_order(x)
    per_sample = x.numel() // max(n, 1)
    rows = x.reshape(n, -1) if dense is None or x.is_contiguous() else dense.reshape(n, -1)
    key = row_norms(rows)
    if weight is not None:
        key = key * weight.to(key.device, torch.float32)
    order = torch.argsort(key, descending=True)
    in_place = (dense is not None and x.stride(0) == per_sample and per_sample % group_size == 0
                and x.device.type == "cpu" and _plain(x) and x.dtype in _KERNEL_DTYPES)
    if not in_place:
        parts, at = [], 0
        for bits, k in runs:
            idx = order[at:at + k]
            at += k
            parts.append((idx, quantize(rows.index_select(0, idx), bits,
                                        group_size=group_size, zero_code=zero_code)))
        return PackedSamples(tuple(parts), x.shape, x.dtype)
    from actune_kernels import cpu_rows as kernels

    by_rank = torch.tensor([b for b, k in runs for _ in range(k)], dtype=torch.uint8)
    row_bits = torch.empty(n, dtype=torch.uint8)
    row_bits[order] = by_rank
    sizes = row_bits.to(torch.int64) * (per_sample // 8)
    row_offset = torch.cumsum(sizes, 0) - sizes
    total = sum(b * k for b, k in runs) * (per_sample // 8)
    codes = torch.empty(total, dtype=torch.uint8)
    meta = torch.empty((x.numel() // group_size, 2), dtype=torch.int16)
    kernels.pack_rows(_numpy(dense.reshape(-1)), _numpy(codes), _numpy(meta),
                      row_bits.numpy(), row_offset.numpy(), group_size, _draw_seed(), 0, True,
                      zero_code)
    return PackedRows(codes, meta, row_bits, row_offset, group_size, x.shape, x.dtype,
                      tuple(x.stride()), zero_code)


def dequantize_samples(p: PackedSamples | PackedRows) -> torch.Tensor:
    """The tensor ``p`` was made from, up to quantization error (:class:`PackedRows`: same
    strides; :class:`PackedSamples`: contiguous)."""
    if isinstance(p, PackedRows):
        from actune_kernels import cpu_rows as kernels

        numel = math.prod(p.shape)
        flat = torch.empty(numel, dtype=p.dtype)
        kernels.unpack_rows(_numpy(p.codes), _numpy(p.meta), p.row_bits.numpy(),
                            p.row_offset.numpy(), p.group_size, _numpy(flat), p.zero_code)
        return flat.as_strided(p.shape, p.stride)
    n = p.shape[0]
    out = torch.empty((n, math.prod(p.shape[1:])), dtype=p.dtype, device=p.device)
    for idx, part in p.parts:
        out.index_copy_(0, idx, dequantize(part))
    return out.view(p.shape)


@dataclass(frozen=True)
class PackedMask:
    """A boolean tensor stored at 1 bit per element (exact)."""

    bits8: torch.Tensor
    shape: torch.Size

    @property
    def nbytes(self) -> int:
        return self.bits8.nbytes

    @property
    def device(self) -> torch.device:
        return self.bits8.device


def pack_mask(mask: torch.Tensor) -> PackedMask:
    """Pack a boolean tensor into 1 bit per element."""
    flat = mask.detach().reshape(-1)
    if flat.device.type == "cpu" and _plain(flat):  # NumPy's packbits: one pass, same layout
        return PackedMask(torch.from_numpy(np.packbits(flat.numpy(), bitorder="little")),
                          mask.shape)
    pad = (-flat.numel()) % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=flat.device)
    bits8 = (flat.view(-1, 8).to(torch.uint8) * weights).sum(dim=1, dtype=torch.uint8)
    return PackedMask(bits8, mask.shape)


def unpack_mask(p: PackedMask) -> torch.Tensor:
    """The boolean tensor ``p`` was packed from."""
    n = 1
    for d in p.shape:
        n *= d
    if p.bits8.device.type == "cpu" and _plain(p.bits8):
        bits = np.unpackbits(p.bits8.numpy(), count=n, bitorder="little")
        return torch.from_numpy(bits.view(np.bool_)).view(p.shape)
    shifts = torch.arange(8, dtype=torch.uint8, device=p.bits8.device)
    bits = ((p.bits8.unsqueeze(1) >> shifts) & 1).view(-1)[:n]
    return bits.view(p.shape).bool()


@dataclass(frozen=True)
class PackedCodes:
    """Small integer codes (each below ``2 ** bits``) stored at ``bits`` per element, exact.
    With ``levels`` they stand for values (a codebook's: :mod:`actune.codebooks`), code ``k``
    for ``levels[k]`` in ``dtype``: :func:`dequantize_codes` reads them back so."""

    bytes8: torch.Tensor
    shape: torch.Size
    bits: int
    levels: tuple[float, ...] | None = None
    dtype: torch.dtype | None = None

    @property
    def nbytes(self) -> int:
        return self.bytes8.nbytes

    @property
    def device(self) -> torch.device:
        return self.bytes8.device


#: The widths :func:`pack_codes` takes: a byte holds a whole number of codes.
CODE_BITS = (1, 2, 4, 8)


def pack_codes(codes: torch.Tensor, bits: int, levels: tuple[float, ...] | None = None,
               dtype: torch.dtype | None = None) -> PackedCodes:
    """Pack unsigned 8-bit ``codes`` (each below ``2 ** bits``) at ``bits`` per element, the
    first code of each byte in its low bits; ``levels`` and ``dtype``: the values they stand
    for (see :class:`PackedCodes`). Plain tensor ops: any device, fake tensors too."""
    if bits not in CODE_BITS:
        raise ValueError(f"codes are packed at {CODE_BITS} bits, not {bits}")
    if levels is not None and len(levels) > 2 ** bits:
        raise ValueError(f"{len(levels)} levels do not fit {bits}-bit codes")
    flat = codes.detach().reshape(-1)
    if bits == 8:
        return PackedCodes(flat.clone(), codes.shape, bits, levels, dtype)
    per = 8 // bits
    pad = (-flat.numel()) % per
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    # one strided column per position in the byte (each pass over a byte's worth of codes,
    # not a shifted copy of every code)
    columns = flat.view(-1, per)
    bytes8 = columns[:, 0].clone()
    for j in range(1, per):
        bytes8 |= columns[:, j] << (j * bits)
    return PackedCodes(bytes8, codes.shape, bits, levels, dtype)


def unpack_codes(p: PackedCodes) -> torch.Tensor:
    """The unsigned 8-bit codes ``p`` was packed from."""
    if p.bits == 8:
        return p.bytes8.view(p.shape)
    n = math.prod(p.shape)
    shifts = torch.arange(0, 8, p.bits, dtype=torch.uint8, device=p.bytes8.device)
    codes = (p.bytes8.unsqueeze(1) >> shifts) & ((1 << p.bits) - 1)
    return codes.view(-1)[:n].view(p.shape)


def dequantize_codes(p: PackedCodes) -> torch.Tensor:
    """The values ``p``'s codes stand for (``p.levels`` in ``p.dtype``), read a byte at a
    time: each byte's values from a table of all 256, one gather, no codes unpacked."""
    if p.levels is None or p.dtype is None:
        raise ValueError("these codes stand for no values: packed without levels")
    table = _byte_table(p.levels, p.bits, p.bytes8, p.dtype)
    n = math.prod(p.shape)
    out = table.index_select(0, p.bytes8.int()).view(-1)
    return (out[:n] if out.numel() > n else out).view(p.shape)


def _byte_table(levels: tuple[float, ...], bits: int, like: torch.Tensor,
                dtype: torch.dtype) -> torch.Tensor:
    """``[256, 8 // bits]``: each byte's values, its first code in the low bits; made once per
    device and dtype for real tensors, afresh for fake or traced ones."""
    if type(like) is not torch.Tensor or compiling():
        return torch.tensor(_table_values(levels, bits), dtype=dtype, device=like.device)
    return _real_table(levels, bits, like.device, dtype)


@functools.cache
def _real_table(levels: tuple[float, ...], bits: int, device: torch.device,
                dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(_table_values(levels, bits), dtype=dtype, device=device)


def _table_values(levels: tuple[float, ...], bits: int) -> list[list[float]]:
    per, mask = 8 // bits, (1 << bits) - 1
    padded = (*levels, *(levels[-1:] * ((1 << bits) - len(levels))))
    return [[padded[(byte >> (j * bits)) & mask] for j in range(per)] for byte in range(256)]


# (after the names it builds on: it imports them from this module)
from actune import quant_columns as _columns  # noqa: E402
