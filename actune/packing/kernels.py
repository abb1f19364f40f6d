"""The torch side of the kernels: buffers allocated with torch, handed to the Numba kernels.

The byte format and the kernels live in ``actune_kernels`` (no torch there). Every buffer is
allocated with torch, so the caching allocator and torch's memory statistics see all of it, and
handed to the kernels as NumPy views or addresses on the CPU and as zero-copy
``__cuda_array_interface__`` views on CUDA, launched on torch's current stream. Packing and
unpacking a flat tensor are registered as ``torch.library`` custom ops with fake (shape-only)
implementations, so code that calls them runs under ``FakeTensorMode`` and passes
``torch.library.opcheck``. The backends of :mod:`actune.packing` build on these names.
"""

from __future__ import annotations

import functools
import mmap

import numpy as np
import torch
from torch._subclasses.fake_tensor import FakeTensor

from actune import tunables

SEED_RANGE = 2**31 - 1
KERNEL_DTYPES = (torch.float32, torch.float64)


# ---------------------------------------------------------------------------------------------
# Kernel dispatch: CPU through NumPy views, CUDA through __cuda_array_interface__.


class _CompilingFlag:
    """An older torch without a compile session's flag: its function answers."""

    @property
    def _is_compiling_flag(self) -> bool:
        return torch.compiler.is_compiling()


#: ``COMPILE._is_compiling_flag``: ``torch.compiler.is_compiling()`` as an attribute read, from
#: the flag torch holds for a whole compile session, Dynamo's tracing included (outside
#: TorchScript, the same); the per-tensor paths read it with no call.
COMPILE = (torch.compiler if hasattr(torch.compiler, "_compile_session_context")
           else _CompilingFlag())


def compiling() -> bool:
    """Is torch compiling (:data:`COMPILE`)?"""
    return COMPILE._is_compiling_flag


def draw_seed() -> int:
    return int(torch.randint(0, SEED_RANGE, (), device="cpu").item())


#: numba's handle of each torch CUDA stream a kernel was launched on, by its address (made
#: once: the kernels' launch configurations are cached per stream object).
_STREAMS: dict[int, object] = {}


def cuda_launch(fn, *tensors, **kw):
    from numba import cuda

    arrays = [cuda.as_cuda_array(t, sync=False) for t in tensors]
    arrays = [a.view(np.uint16) if a.dtype == np.int16 else a for a in arrays]
    address = torch.cuda.current_stream(tensors[0].device).cuda_stream
    stream = _STREAMS.get(address)
    if stream is None:
        stream = _STREAMS[address] = cuda.external_stream(address)
    fn(*arrays, stream=stream, **kw)


@functools.cache
def cpu_kernels():
    from actune_kernels import cpu

    return cpu


#: The kernels' dtypes as NumPy names them: the CPU kernels take buffers by address (reading a
#: tensor's address costs a tenth of making a NumPy array of it).
NUMPY_DTYPES = {torch.float32: np.dtype(np.float32), torch.float64: np.dtype(np.float64)}


def numpy_view(t: torch.Tensor) -> np.ndarray:
    a = t.detach().numpy()
    return a.view(np.uint16) if a.dtype == np.int16 else a


_HUGE_PAGES = hasattr(mmap, "MADV_HUGEPAGE")


def empty_cpu(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised 1-D CPU tensor; from ``tunables.HUGE_OUTPUT_BYTES`` up, in its own anonymous
    mapping advised to use huge pages (freed with the tensor's storage)."""
    nbytes = numel * dtype.itemsize
    if nbytes < tunables.HUGE_OUTPUT_BYTES or not _HUGE_PAGES:
        return torch.empty(numel, dtype=dtype)
    buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buffer.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(buffer, dtype=dtype)


def pack_flat(x: torch.Tensor, bits: int, group_size: int, seed: int, stochastic: bool,
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
        seed = draw_seed()
    src = x if x.dtype in KERNEL_DTYPES else x.float()
    if on_cpu:
        src = src.contiguous()  # (itself when it is)
        cpu_kernels().pack_at(src.data_ptr(), n, NUMPY_DTYPES[src.dtype], codes.data_ptr(),
                               meta.data_ptr(), bits, group_size, seed, 0, stochastic, zero_code)
    elif device.type == "cuda":
        from actune_kernels import cuda as kernels

        cuda_launch(lambda a, c, m, stream: kernels.pack(a, c, m, bits, group_size, seed, 0,
                                                           stochastic, zero_code, stream=stream),
                     src.reshape(-1), codes, meta)
    elif device.type != "meta":  # (the meta device: shapes and host work only, no values)
        raise NotImplementedError(f"actune has kernels for CPU and CUDA tensors, not {x.device}")
    return codes, meta


pack_op = torch.library.custom_op("actune::pack", mutates_args=())(pack_flat)


@pack_op.register_fake
def fake_pack(x, bits, group_size, seed, stochastic, zero_code):
    n = x.numel()
    groups = -(-n // group_size)
    codes = x.new_empty((groups * (group_size * bits // 8),), dtype=torch.uint8)
    meta = x.new_empty((groups, 2), dtype=torch.int16)
    return codes, meta


def unpack_flat(codes: torch.Tensor, meta: torch.Tensor, bits: int, group_size: int,
               numel: int, dtype: torch.dtype, zero_code: bool) -> torch.Tensor:
    """Dequantize to a 1-D tensor of ``numel`` elements of ``dtype``."""
    work = dtype if dtype in KERNEL_DTYPES else torch.float32
    on_cpu = codes.is_cpu
    out = (empty_cpu(numel, work) if on_cpu
           else torch.empty(numel, dtype=work, device=codes.device))
    if numel:
        if on_cpu:
            unpack_cpu(codes, meta, bits, group_size, out, numel, zero_code)
        elif codes.device.type == "cuda":
            from actune_kernels import cuda as kernels

            cuda_launch(lambda c, m, o, stream: kernels.unpack(c, m, bits, group_size, o,
                                                                 zero_code, stream=stream),
                         codes, meta, out)
        elif codes.device.type != "meta":
            raise NotImplementedError(
                f"actune has kernels for CPU and CUDA tensors, not {codes.device}")
    return out if work == dtype else out.to(dtype)


def unpack_cpu(codes: torch.Tensor, meta: torch.Tensor, bits: int, group_size: int,
                out: torch.Tensor, numel: int, zero_code: bool) -> None:
    """Fill ``out`` (CPU, float32/64, dense in any layout: written in memory order)."""
    codes, meta = codes.contiguous(), meta.contiguous()  # (a packed value built by hand)
    cpu_kernels().unpack_at(codes.data_ptr(), meta.data_ptr(), bits, group_size,
                             out.data_ptr(), numel, NUMPY_DTYPES[out.dtype], zero_code)


unpack_op = torch.library.custom_op("actune::unpack", mutates_args=())(unpack_flat)


@unpack_op.register_fake
def fake_unpack(codes, meta, bits, group_size, numel, dtype, zero_code):
    return codes.new_empty((numel,), dtype=dtype)


# ---------------------------------------------------------------------------------------------
# Public API.


def plain(t: torch.Tensor) -> bool:
    """Eager, real tensors call the kernels directly (the same function the op registers),
    skipping the dispatcher's overhead; fake tensors and traced code go through the op."""
    return type(t) is torch.Tensor and not compiling()


def shapes_only(t: torch.Tensor) -> bool:
    """A fake tensor outside tracing (an estimate): only shapes and bytes matter."""
    return isinstance(t, FakeTensor) and not compiling()


def storage_order(x: torch.Tensor) -> torch.Tensor | None:
    """``x`` permuted so that its memory order is row-major, or None if it is not dense."""
    if x.is_contiguous():
        return x
    order = sorted(range(x.dim()), key=lambda d: (-x.stride(d), -x.size(d)))
    permuted = x.permute(order)
    return permuted if permuted.is_contiguous() else None
