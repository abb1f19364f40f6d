"""Numba CUDA kernels: one warp per group, every access coalesced, reductions in registers.

Pack, per group: the 32 lanes read the group in 32-element rows (lane ``l`` reads element
``row * 32 + l``: each row is one 128-byte transaction for float32), reduce min, max and a
non-finite flag with butterfly shuffles (``shfl_xor``: every lane ends with the result, no
shared memory, no barrier), derive the group's metadata, then read the rows again (from cache)
and round. The ``8 // bits`` lanes that hold the codes of one byte OR them together with
shuffles, and the first of them writes the byte: consecutive lanes write consecutive bytes.
Unpack reads and writes in the same rows. Warps loop over groups (a grid-stride loop) so a
launch of bounded size covers any tensor, and each lane handles ``group_size / 32`` elements
a group. The random stream is computed in 32-bit unsigned arithmetic (:func:`scalar.
random24_u32`: the same bits as the CPU's), and products are unfused (``fastmath`` off), so
the bytes are the CPU kernels' and the reference's.

In numba-cuda's simulator (``NUMBA_ENABLE_CUDASIM=1`` before numba is imported) the shuffle is
emulated through shared memory with the same semantics, and the random stream runs in Python
integers; the compiled kernels use the hardware shuffle (checked by compiling to PTX).
"""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace
from unittest import mock

import numpy as np
from numba import config, cuda, float64, int64

from . import layout
from .scalar import INV_2_24, MASK32, build, random24_u32

_s = build(cuda.jit(device=True))
_stream_key = _s.stream_key
_group_meta = _s.group_meta
_meta_values = _s.meta_values

WARP = 32
#: Groups (warps) per block.
WARPS_PER_BLOCK = 4
#: The most blocks one launch starts (the warps then loop over the remaining groups).
MAX_BLOCKS = 8192
_FULL = 0xFFFFFFFF

if config.ENABLE_CUDASIM:  # the simulator runs NumPy scalars: IEEE products, never fused

    @cuda.jit(device=True)
    def _MUL32(a, b):  # noqa: N802 - stands in for the libdevice function of that role
        return a * b

    _MUL64 = _MUL32

    @cuda.jit(device=True)
    def _random24(key32, idx32):
        return _s.random24(int(key32), int(idx32))  # Python integers, the same bits

    @cuda.jit(device=True)
    def _add32(a, b):
        return np.uint32((int(a) + int(b)) & MASK32)  # (NumPy scalars warn on wrapping)

    @cuda.jit(device=True)
    def _xor(value, lane_mask, buf, row, lane):
        """The value of lane ``lane ^ lane_mask`` (a shuffle, through shared memory ``buf``
        of ``value``'s kind)."""
        cuda.syncthreads()
        buf[row, lane] = value
        cuda.syncthreads()
        return buf[row, lane ^ lane_mask]
else:  # products that the compiler may not fuse into a following add (no FMA contraction)
    from numba.cuda import libdevice

    _MUL32 = libdevice.fmul_rn
    _MUL64 = libdevice.dmul_rn
    _random24 = cuda.jit(device=True)(random24_u32)

    @cuda.jit(device=True)
    def _add32(a, b):
        return np.uint32(a + np.uint32(b))  # wraps at 2**32

    @cuda.jit(device=True)
    def _xor(value, lane_mask, buf, row, lane):  # (buf: the simulator's alone)
        return cuda.shfl_xor_sync(_FULL, value, lane_mask)


def _make_kernels(mul):
    """The pack and unpack kernels (one tensor, and segments of one array: see
    :mod:`actune_kernels.cpu_segments`), with ``mul`` the unfused product for their type."""

    @cuda.jit(device=True)
    def pack_group(x, codes, meta, g, valid, start, end, out0, at, bits, group_size, seed,
                   stochastic, zero_code, rounds, lane, row, fbuf, ibuf):  # pragma: no cover
        """One warp packs ``x[start:end]`` (one group; empty where not ``valid``): metadata
        in ``meta[g]``, codes from byte ``out0``, ``at`` its first element's stream index.
        ``rounds`` of shuffles assemble each byte (the same in every warp of a block: the
        simulator's shuffles are barriers)."""
        t = x.dtype.type
        per = 8 // bits
        levels = (1 << bits) - 1
        u_step = t(INV_2_24)
        half = t(0.5)
        first = 1 if zero_code else 0  # zero-code mode: code 0 is an exact zero
        mn = t(math.inf)
        mx = t(-math.inf)
        flag = t(0)
        for i in range(start + lane, end, WARP):
            v = x[i]
            if v > 0 or not zero_code:  # zero-code mode: the smallest positive value
                mn = min(mn, v)
            mx = max(mx, v)
            flag += v - v  # NaN for NaN and inf
        for m in (16, 8, 4, 2, 1):
            mn = min(mn, _xor(mn, m, fbuf, row, lane))
            mx = max(mx, _xor(mx, m, fbuf, row, lane))
            flag += _xor(flag, m, fbuf, row, lane)
        lo_word, scale_word, lo64, scale64 = _group_meta(
            math.nan if flag != 0 else float(mn), float(mx), float(levels - first),
            zero_code)
        if lane == 0 and valid:
            meta[g, 0] = lo_word
            meta[g, 1] = scale_word
        finite = lo_word != layout.NAN16
        lo = t(lo64)
        scale = t(scale64)
        inv = t(1) / scale if scale > 0 else scale
        low0 = np.uint32(at & MASK32)  # the stream index of the group's first element
        key0 = np.uint32(_stream_key(seed, at >> 32))
        key1 = np.uint32(_stream_key(seed, (at >> 32) + 1))  # past a 2**32 boundary
        for row0 in range(0, group_size, WARP):
            o = row0 + lane
            i = start + o
            code = 0
            if i < end and finite:
                xi = x[i]
                v = mul(xi - lo, inv)
                fl = int(math.floor(v))  # noqa: RUF046 - a float on CUDA
                frac = v - fl
                if stochastic:
                    idx = _add32(low0, o)
                    key = key1 if idx < low0 else key0
                    up = t(_random24(key, idx)) * u_step < frac
                else:
                    up = frac >= half
                code = min(max(fl + first + (1 if up else 0), first), levels)
                if zero_code and not xi > 0:
                    code = 0
            word = np.int32(code << ((lane % per) * bits))
            m = 1
            for _ in range(rounds):  # the byte's lanes OR their codes together
                other = np.int32(_xor(word, m, ibuf, row, lane))
                if m < per:
                    word = np.int32(word | other)
                m *= 2
            if lane % per == 0 and o < group_size and valid:
                codes[out0 + o // per] = word

    @cuda.jit
    def pack_kernel(x, codes, meta, bits, group_size, seed, base, stochastic,
                    zero_code):  # pragma: no cover - compiled
        lane = cuda.threadIdx.x
        row = cuda.threadIdx.y
        # (the simulator's shuffles; compiled kernels never touch these)
        fbuf = cuda.shared.array((WARPS_PER_BLOCK, WARP), float64)
        ibuf = cuda.shared.array((WARPS_PER_BLOCK, WARP), int64)
        n = x.size
        groups = meta.shape[0]
        group_bytes = group_size * bits // 8
        rounds = 3 if bits == 1 else 2 if bits == 2 else 1 if bits == 4 else 0
        # every warp of a block makes the same number of turns (the simulator's barriers)
        for block in range(cuda.blockIdx.x, -(-groups // WARPS_PER_BLOCK), cuda.gridDim.x):
            g = block * WARPS_PER_BLOCK + row
            start = g * group_size
            end = min(start + group_size, n)  # empty past the last group
            pack_group(x, codes, meta, g, g < groups, start, end, g * group_bytes,
                       base + start, bits, group_size, seed, stochastic, zero_code, rounds,
                       lane, row, fbuf, ibuf)

    @cuda.jit
    def pack_segments_kernel(x, codes, meta, table, group_size, seed,
                             stochastic):  # pragma: no cover - compiled
        lane = cuda.threadIdx.x
        row = cuda.threadIdx.y
        fbuf = cuda.shared.array((WARPS_PER_BLOCK, WARP), float64)
        ibuf = cuda.shared.array((WARPS_PER_BLOCK, WARP), int64)
        groups = meta.shape[0]
        for block in range(cuda.blockIdx.x, -(-groups // WARPS_PER_BLOCK), cuda.gridDim.x):
            g = block * WARPS_PER_BLOCK + row
            valid = g < groups
            s = _segment_of(table, min(g, groups - 1))
            bits = table[3, s]
            local = g - table[1, s]
            start = table[0, s] + local * group_size
            end = min(start + group_size, table[0, s + 1]) if valid else start
            # the widths of a block's warps differ: three rounds of byte assembly in each
            pack_group(x, codes, meta, g, valid, start, end,
                       table[2, s] + local * (group_size * bits // 8), start, bits,
                       group_size, seed, stochastic, table[4, s] != 0, 3, lane, row, fbuf,
                       ibuf)

    @cuda.jit(device=True)
    def unpack_group(codes, lo64, scale64, y, start, end, at, bits, group_size, zero_code,
                     lane):  # pragma: no cover - compiled
        t = y.dtype.type
        per = 8 // bits
        mask = (1 << bits) - 1
        lo = t(lo64)
        scale = t(scale64)
        for row0 in range(0, group_size, WARP):
            o = row0 + lane
            i = start + o
            if o < group_size and i < end:
                q = (codes[at + o // per] >> ((o % per) * bits)) & mask
                if zero_code:
                    y[i] = lo + mul(t(q - 1), scale) if q else t(0)
                else:
                    y[i] = lo + mul(t(q), scale)

    @cuda.jit
    def unpack_kernel(codes, meta, bits, group_size, zero_code, y):  # pragma: no cover
        lane = cuda.threadIdx.x
        row = cuda.threadIdx.y
        n = y.size
        groups = meta.shape[0]
        group_bytes = group_size * bits // 8
        for block in range(cuda.blockIdx.x, -(-groups // WARPS_PER_BLOCK), cuda.gridDim.x):
            g = block * WARPS_PER_BLOCK + row
            if g >= groups:
                continue
            lo64, scale64 = _meta_values(meta[g, 0], meta[g, 1])
            unpack_group(codes, lo64, scale64, y, g * group_size, n, g * group_bytes, bits,
                         group_size, zero_code, lane)

    @cuda.jit
    def unpack_segments_kernel(codes, meta, table, group_size, y):  # pragma: no cover
        lane = cuda.threadIdx.x
        row = cuda.threadIdx.y
        groups = meta.shape[0]
        for block in range(cuda.blockIdx.x, -(-groups // WARPS_PER_BLOCK), cuda.gridDim.x):
            g = block * WARPS_PER_BLOCK + row
            if g >= groups:
                continue
            s = _segment_of(table, g)
            bits = table[3, s]
            local = g - table[1, s]
            lo64, scale64 = _meta_values(meta[g, 0], meta[g, 1])
            unpack_group(codes, lo64, scale64, y, table[0, s] + local * group_size,
                         table[0, s + 1], table[2, s] + local * (group_size * bits // 8),
                         bits, group_size, table[4, s] != 0, lane)

    return pack_kernel, unpack_kernel, pack_segments_kernel, unpack_segments_kernel


@cuda.jit(device=True)
def _segment_of(table, g):  # pragma: no cover - compiled
    """The segment holding group ``g``: the last ``s`` with ``table[1, s] <= g`` (empty
    segments own no group)."""
    lo = 0
    hi = table.shape[1] - 1  # the group row ends with the number of groups
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if table[1, mid] <= g:
            lo = mid
        else:
            hi = mid
    return lo


_KERNELS = {"float32": _make_kernels(_MUL32), "float64": _make_kernels(_MUL64)}


def grid(groups: int) -> tuple[int, tuple[int, int]]:
    """(blocks, (lanes, warps a block)) of a launch over ``groups`` groups."""
    return min(-(-groups // WARPS_PER_BLOCK), MAX_BLOCKS), (WARP, WARPS_PER_BLOCK)


@functools.lru_cache(maxsize=64)
def _configured(kind: int, dtype: str, blocks: int, stream):
    """The kernel with its launch configuration (made once per size and stream)."""
    return _KERNELS[dtype][kind][blocks, (WARP, WARPS_PER_BLOCK), stream]


def pack(x, codes, meta, bits: int, group_size: int, seed: int, base: int = 0,
         stochastic: bool = True, zero_code: bool = False, stream=0) -> None:
    """Fill ``codes`` and ``meta`` (device arrays) from 1-D float32/float64 device array ``x``,
    launched on ``stream``. Same arguments and bytes as :func:`actune_kernels.cpu.pack`."""
    groups = meta.shape[0]
    if groups:
        launch = _configured(0, str(x.dtype), grid(groups)[0], stream)
        launch(x, codes, meta, bits, group_size, seed, base, stochastic, zero_code)


def unpack(codes, meta, bits: int, group_size: int, out, zero_code: bool = False,
           stream=0) -> None:
    """Fill 1-D device array ``out`` from ``codes`` and ``meta``, launched on ``stream``."""
    groups = meta.shape[0]
    if groups:
        launch = _configured(1, str(out.dtype), grid(groups)[0], stream)
        launch(codes, meta, bits, group_size, zero_code, out)


def pack_segments(x, codes, meta, table, group_size: int, seed: int, stochastic: bool = True,
                  stream=0) -> None:
    """Pack the segments of device array ``x`` in one launch: the arguments of
    :func:`actune_kernels.cpu_segments.pack_segments` (``table`` a device array), the same
    bytes."""
    groups = meta.shape[0]
    if groups:
        launch = _configured(2, str(x.dtype), grid(groups)[0], stream)
        launch(x, codes, meta, table, group_size, seed, stochastic)


def unpack_segments(codes, meta, table, group_size: int, out, stream=0) -> None:
    """Fill device array ``out`` from what :func:`pack_segments` wrote, in one launch."""
    groups = meta.shape[0]
    if groups:
        launch = _configured(3, str(out.dtype), grid(groups)[0], stream)
        launch(codes, meta, table, group_size, out)


PACK_SIGNATURE = ("void({0}[::1], uint8[::1], uint16[:, ::1], int64, int64, int64, int64, "
                  "boolean, boolean)")
UNPACK_SIGNATURE = "void(uint8[::1], uint16[:, ::1], int64, int64, boolean, {0}[::1])"
PACK_SEGMENTS_SIGNATURE = ("void({0}[::1], uint8[::1], uint16[:, ::1], int64[:, ::1], int64, "
                           "int64, boolean)")
UNPACK_SEGMENTS_SIGNATURE = "void(uint8[::1], uint16[:, ::1], int64[:, ::1], int64, {0}[::1])"


def compile_ptx(cc: tuple[int, int] = (9, 0), dtype: str = "float32") -> dict[str, str]:
    """PTX of the four kernels for ``dtype`` input at compute capability ``cc``.

    Needs NVRTC/NVVM (the ``numba-cuda[cu13]`` wheels) but no GPU: the proof on a machine
    without one that the kernels compile. numba-cuda asks the current device for its compute
    capability when it compiles a device function; here that question is answered with ``cc``.
    """
    from numba.cuda import dispatcher

    device = SimpleNamespace(compute_capability=cc)
    signatures = (PACK_SIGNATURE, UNPACK_SIGNATURE, PACK_SEGMENTS_SIGNATURE,
                  UNPACK_SEGMENTS_SIGNATURE)
    names = ("pack", "unpack", "pack_segments", "unpack_segments")
    with mock.patch.object(dispatcher, "get_current_device", return_value=device):
        return {name: cuda.compile_ptx(kernel.py_func, signature.format(dtype), cc=cc)[0]
                for name, kernel, signature in zip(names, _KERNELS[dtype], signatures,
                                                   strict=True)}
