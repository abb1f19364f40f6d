"""Numba CUDA kernels: one warp per group.

The 32 lanes of a warp reduce the group's min and max through shared memory (one barrier;
every lane reads all partials, so all derive the same metadata), and each lane then quantizes
and writes whole bytes, so reads are coalesced and no two lanes write the same byte. The
arithmetic is the CPU kernels' (same shared scalar functions, no fused multiply-add with
``fastmath`` off), so both produce the same bytes.

Runs in numba-cuda's simulator when ``NUMBA_ENABLE_CUDASIM=1`` is set before numba is imported.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from unittest import mock

from numba import config, cuda, float64

from . import layout
from .scalar import INV_2_24, build

_s = build(cuda.jit(device=True))

if config.ENABLE_CUDASIM:  # the simulator runs NumPy scalars: IEEE products, never fused

    @cuda.jit(device=True)
    def _MUL32(a, b):  # noqa: N802 - stands in for the libdevice function of that role
        return a * b

    _MUL64 = _MUL32
else:  # products that the compiler may not fuse into a following add (no FMA contraction)
    from numba.cuda import libdevice

    _MUL32 = libdevice.fmul_rn
    _MUL64 = libdevice.dmul_rn
_stream_key = _s.stream_key
_random24 = _s.random24
_group_meta = _s.group_meta
_meta_values = _s.meta_values

WARP = 32
#: Groups (warps) per block.
WARPS_PER_BLOCK = 4


def _make_kernels(mul):
    """The pack and unpack kernels, with ``mul`` the unfused product for their float type."""

    @cuda.jit
    def pack_kernel(x, codes, meta, bits, group_size, seed, base, stochastic,
                    zero_code):  # pragma: no cover - compiled
        lane = cuda.threadIdx.x
        row = cuda.threadIdx.y
        g = cuda.blockIdx.x * cuda.blockDim.y + row
        n = x.size
        start = g * group_size
        end = min(start + group_size, n)
        mn = math.inf
        mx = -math.inf
        flag = 0.0
        for i in range(start + lane, end, WARP):
            v = x[i]
            if v > 0 or not zero_code:  # zero-code mode: the smallest positive value
                mn = min(mn, v)
            mx = max(mx, v)
            flag += v - v
        # Reduce over the warp through shared memory; every lane reads all 32 partials, so all
        # lanes hold the same result after one barrier.
        s_mn = cuda.shared.array((WARPS_PER_BLOCK, WARP), float64)
        s_mx = cuda.shared.array((WARPS_PER_BLOCK, WARP), float64)
        s_flag = cuda.shared.array((WARPS_PER_BLOCK, WARP), float64)
        s_mn[row, lane] = mn
        s_mx[row, lane] = mx
        s_flag[row, lane] = flag
        cuda.syncthreads()
        if g >= meta.shape[0]:
            return
        for j in range(WARP):
            mn = min(mn, s_mn[row, j])
            mx = max(mx, s_mx[row, j])
            flag += s_flag[row, j]
        if flag != 0.0:
            mn = math.nan
        levels = (1 << bits) - 1
        lo_word, scale_word, lo64, scale64 = _group_meta(mn, mx, float(levels - zero_code),
                                                         zero_code)
        if lane == 0:
            meta[g, 0] = lo_word
            meta[g, 1] = scale_word
        per = 8 // bits
        group_bytes = group_size * bits // 8
        out0 = g * group_bytes
        if lo_word == layout.NAN16:
            for k in range(lane, group_bytes, WARP):
                codes[out0 + k] = 0
            return
        t = x.dtype.type
        lo = t(lo64)
        scale = t(scale64)
        inv = t(1) / scale if scale > 0 else scale
        u_step = t(INV_2_24)
        half = t(0.5)
        hi0 = (base + start) >> 32
        key0 = _stream_key(seed, hi0)
        key1 = _stream_key(seed, hi0 + 1)
        for k in range(lane, group_bytes, WARP):
            byte = 0
            for j in range(per):
                i = start + k * per + j
                if i < end:
                    v = mul(x[i] - lo, inv)
                    fl = int(math.floor(v))  # noqa: RUF046 - a float on CUDA
                    frac = v - fl
                    if stochastic:
                        idx = base + i
                        key = key0 if (idx >> 32) == hi0 else key1
                        up = t(_random24(key, idx)) * u_step < frac
                    else:
                        up = frac >= half
                    first = 1 if zero_code else 0  # zero-code mode: code 0 is an exact zero
                    c = min(max(fl + first + (1 if up else 0), first), levels)
                    if zero_code and not x[i] > 0:
                        c = 0
                    byte |= c << (bits * j)
            codes[out0 + k] = byte


    @cuda.jit
    def unpack_kernel(codes, meta, bits, group_size, zero_code, y):  # pragma: no cover
        lane = cuda.threadIdx.x
        g = cuda.blockIdx.x * cuda.blockDim.y + cuda.threadIdx.y
        if g >= meta.shape[0]:
            return
        n = y.size
        t = y.dtype.type
        lo64, scale64 = _meta_values(meta[g, 0], meta[g, 1])
        lo = t(lo64)
        scale = t(scale64)
        per = 8 // bits
        mask = (1 << bits) - 1
        group_bytes = group_size * bits // 8
        start = g * group_size
        for k in range(lane, group_bytes, WARP):
            byte = codes[g * group_bytes + k]
            for j in range(per):
                i = start + k * per + j
                if i < n:
                    q = (byte >> (bits * j)) & mask
                    if zero_code:
                        y[i] = lo + mul(t(q - 1), scale) if q else t(0)
                    else:
                        y[i] = lo + mul(t(q), scale)

    return pack_kernel, unpack_kernel


_KERNELS = {"float32": _make_kernels(_MUL32), "float64": _make_kernels(_MUL64)}


def _grid(groups: int) -> tuple[int, tuple[int, int]]:
    return -(-groups // WARPS_PER_BLOCK), (WARP, WARPS_PER_BLOCK)


def pack(x, codes, meta, bits: int, group_size: int, seed: int, base: int = 0,
         stochastic: bool = True, zero_code: bool = False, stream=0) -> None:
    """Fill ``codes`` and ``meta`` (device arrays) from 1-D float32/float64 device array ``x``,
    launched on ``stream``. Same arguments and bytes as :func:`actune_kernels.cpu.pack`."""
    groups = meta.shape[0]
    if groups:
        blocks, threads = _grid(groups)
        kernel = _KERNELS[str(x.dtype)][0]
        kernel[blocks, threads, stream](x, codes, meta, bits, group_size, seed, base, stochastic,
                                        zero_code)


def unpack(codes, meta, bits: int, group_size: int, out, zero_code: bool = False,
           stream=0) -> None:
    """Fill 1-D device array ``out`` from ``codes`` and ``meta``, launched on ``stream``."""
    groups = meta.shape[0]
    if groups:
        blocks, threads = _grid(groups)
        kernel = _KERNELS[str(out.dtype)][1]
        kernel[blocks, threads, stream](codes, meta, bits, group_size, zero_code, out)


def compile_ptx(cc: tuple[int, int] = (9, 0)) -> dict[str, str]:
    """PTX of both kernels for float32 input at compute capability ``cc``.

    Needs NVRTC/NVVM (the ``numba-cuda[cu13]`` wheels) but no GPU: the proof on a machine
    without one that the kernels compile. numba-cuda asks the current device for its compute
    capability when it compiles a device function; here that question is answered with ``cc``.
    """
    from numba.cuda import dispatcher

    pack_sig = ("void(float32[::1], uint8[::1], uint16[:, ::1], int64, int64, int64, int64, "
                "boolean, boolean)")
    unpack_sig = "void(uint8[::1], uint16[:, ::1], int64, int64, boolean, float32[::1])"
    device = SimpleNamespace(compute_capability=cc)
    pack_kernel, unpack_kernel = _KERNELS["float32"]
    with mock.patch.object(dispatcher, "get_current_device", return_value=device):
        return {
            "pack": cuda.compile_ptx(pack_kernel.py_func, pack_sig, cc=cc)[0],
            "unpack": cuda.compile_ptx(unpack_kernel.py_func, unpack_sig, cc=cc)[0],
        }
