"""NumPy reference of the packed format: the specification in code, written for reading.

It shares nothing with the compiled kernels but the constants, so agreement between the
three implementations (tested byte for byte) checks each of them. Slow; for tests only.
"""

from __future__ import annotations

import numpy as np

from . import layout
from .scalar import (
    BF16_MAX_ABS,
    BF16_MIN_SCALE,
    BF16_TINY,
    FP16_MAX_ABS,
    FP16_MIN_SCALE,
    GOLDEN,
    INV_2_24,
    MUL1,
    MUL2,
)

_M32 = np.uint64(0xFFFFFFFF)


def mix32(x: np.ndarray) -> np.ndarray:
    """The 32-bit mixer on uint64 arrays holding 32-bit values."""
    x = np.asarray(x, dtype=np.uint64) & _M32
    x ^= x >> np.uint64(16)
    x = (x * np.uint64(MUL1)) & _M32
    x ^= x >> np.uint64(15)
    x = (x * np.uint64(MUL2)) & _M32
    x ^= x >> np.uint64(16)
    return x


def random24(seed: int, index: np.ndarray) -> np.ndarray:
    """24 random bits per element index: hash(low word of index XOR key(seed, high word))."""
    index = np.asarray(index, dtype=np.uint64)
    key = mix32(np.uint64(seed) ^ mix32((index >> np.uint64(32)) + np.uint64(GOLDEN)))
    return mix32((index & _M32) ^ key) >> np.uint64(8)


def _fp16_down(v: np.ndarray) -> np.ndarray:
    """Largest float16 <= v."""
    h = v.astype(np.float16)
    return np.where(h.astype(np.float64) > v, np.nextafter(h, np.float16(-np.inf)), h)


def _bf16_ulp(a: np.ndarray) -> np.ndarray:
    return np.ldexp(1.0, np.maximum(np.frexp(a)[1] - 8, -133))


def _bf16_down(v: np.ndarray) -> np.ndarray:
    """Largest bfloat16 <= v, as float64."""
    u = _bf16_ulp(np.abs(v) + (v == 0))
    return np.where(v == 0, 0.0, np.floor(v / u) * u)


def _fit(mn, mx, levels, down, up, step):
    lo = down(mn) + 0.0  # -0.0 becomes +0.0, as in the kernels
    scale = up((mx - lo) / levels) + 0.0
    short = lo + levels * scale < mx
    while short.any():  # the rounded division fell short of the maximum: one grid step up
        scale = np.where(short, up(scale + step(scale)), scale)
        short = lo + levels * scale < mx
    return lo, scale


def _bf16_bits(v: np.ndarray) -> np.ndarray:
    return (v.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)


def group_meta(mn: np.ndarray, mx: np.ndarray, bits: int, zero_code: bool = False):
    """Metadata words (lo, scale) per group and their float64 values, from group min and max.

    With ``zero_code``, ``mn`` is the smallest positive value (+inf if none), the grid has one
    step fewer above ``lo`` (code 0 is the exact zero) and ``lo`` stays positive.
    """
    levels = float((1 << bits) - 1 - zero_code)
    mn = mn.astype(np.float64)
    mx = mx.astype(np.float64)
    empty = zero_code & (mn > mx)  # no positive value: every code 0, lo = scale = 0
    mn = np.where(empty, 0.0, mn)
    mx = np.where(empty, 0.0, mx)
    big = np.maximum(np.abs(mn), np.abs(mx))
    valid = big <= BF16_MAX_ABS  # False for NaN and inf too
    mn = np.where(valid, mn, 0.0)
    mx = np.where(valid, mx, 0.0)

    lo16, s16 = _fit(
        np.clip(mn, -FP16_MAX_ABS, FP16_MAX_ABS), np.clip(mx, -FP16_MAX_ABS, FP16_MAX_ABS), levels,
        lambda v: _fp16_down(v).astype(np.float64),
        lambda v: -_fp16_down(-v).astype(np.float64),
        lambda s: np.spacing(s.astype(np.float16)).astype(np.float64),
    )
    use16 = valid & (big <= FP16_MAX_ABS) & ((s16 == 0) | (s16 >= FP16_MIN_SCALE))
    if zero_code:
        use16 &= lo16 > 0
        mn = np.where(empty, mn, np.maximum(mn, BF16_TINY))
        mx = np.maximum(mx, mn)
    lob, sb = _fit(mn, mx, levels, _bf16_down, lambda v: -_bf16_down(-v), _bf16_ulp)
    sb = np.where(sb > 0, np.maximum(sb, BF16_MIN_SCALE), sb)  # keeps 1 / scale finite

    lo = np.where(use16, lo16, lob)
    scale = np.where(use16, s16, sb)
    lo_word = np.where(use16, lo16.astype(np.float16).view(np.uint16), _bf16_bits(lob))
    scale_word = np.where(use16, s16.astype(np.float16).view(np.uint16), _bf16_bits(sb) | 0x8000)
    lo_word = np.where(valid, lo_word, layout.NAN16).astype(np.uint16)
    scale_word = np.where(valid, scale_word, 0).astype(np.uint16)
    lo = np.where(valid, lo, np.nan)
    scale = np.where(valid, scale, 0.0)
    if zero_code:
        lo_word = np.where(empty, 0, lo_word).astype(np.uint16)
        scale_word = np.where(empty, 0, scale_word).astype(np.uint16)
        lo = np.where(empty, 0.0, lo)
        scale = np.where(empty, 0.0, scale)
    return lo_word, scale_word, lo, scale


def _grid(x: np.ndarray, group_size: int):
    n = x.size
    g = layout.num_groups(n, group_size)
    padded = np.zeros(g * group_size, dtype=x.dtype)
    padded[:n] = x
    inside = np.arange(g * group_size) < n
    return padded.reshape(g, group_size), inside.reshape(g, group_size)


def pack(x, bits: int, group_size: int = layout.DEFAULT_GROUP_SIZE, seed: int = 0,
         stochastic: bool = True, base: int = 0, zero_code: bool = False):
    """Pack a 1-D float32 or float64 array. Returns (codes uint8[...], meta uint16[G, 2]).

    ``base`` is the stream index of ``x[0]`` (the kernels' random stream is indexed by it).
    ``zero_code`` (for arrays >= 0, bits >= 2): code 0 is an exact zero and every positive
    value gets a code >= 1, so which elements are zero survives quantization exactly.
    """
    layout.check_bits(bits)
    layout.check_group_size(group_size)
    x = np.ascontiguousarray(x).reshape(-1)
    t = x.dtype.type
    grid, inside = _grid(x, group_size)
    finite = np.where(inside, np.isfinite(grid), True).all(axis=1)
    counted = inside & (grid > 0) if zero_code else inside
    mn = np.where(counted, grid, np.inf).min(axis=1, initial=np.inf)
    mx = np.where(inside, grid, -np.inf).max(axis=1, initial=-np.inf)
    mn = np.where(finite, mn, np.nan)
    lo_word, scale_word, lo, scale = group_meta(mn, mx, bits, zero_code)

    levels = (1 << bits) - 1
    lo_t = lo.astype(t)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        inv_t = np.where(scale > 0, t(1) / scale.astype(t), t(0)).astype(t)[:, None]
        v = (grid - lo_t) * inv_t
        floor = np.floor(v)
        frac = v - floor
    if stochastic:
        index = np.uint64(base) + np.arange(grid.size, dtype=np.uint64)
        u = random24(seed, index).reshape(grid.shape).astype(t) * t(INV_2_24)
        up = u < frac
    else:
        up = frac >= t(0.5)
    base_code = 1 if zero_code else 0
    code = np.clip(np.nan_to_num(floor) + base_code + up, base_code, levels).astype(np.uint8)
    code[~inside | ~np.isfinite(lo)[:, None]] = 0
    if zero_code:
        code[~(grid > 0)] = 0

    per = 8 // bits
    shifts = (np.arange(per, dtype=np.uint8) * bits).astype(np.uint8)
    codes = (code.reshape(-1, per) << shifts).sum(axis=1, dtype=np.uint8)
    meta = np.stack([lo_word, scale_word], axis=1)
    return codes.astype(np.uint8), meta


def meta_values(meta: np.ndarray):
    """Decode metadata words [G, 2] into float64 (lo, scale) per group."""
    lo_word = meta[:, 0].astype(np.uint16)
    scale_word = meta[:, 1].astype(np.uint16)
    is_bf = (scale_word & 0x8000) != 0
    lo_bf = (lo_word.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    s_bf = ((scale_word & 0x7FFF).astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    lo = np.where(is_bf, lo_bf, lo_word.view(np.float16).astype(np.float64))
    scale = np.where(is_bf, s_bf, scale_word.view(np.float16).astype(np.float64))
    return lo, scale


def unpack(codes: np.ndarray, meta: np.ndarray, bits: int, numel: int,
           group_size: int = layout.DEFAULT_GROUP_SIZE, dtype=np.float32,
           zero_code: bool = False) -> np.ndarray:
    """Dequantize to a 1-D array of ``numel`` elements of ``dtype`` (float32 or float64):
    ``lo + code * scale`` per element, in ``dtype`` arithmetic (zero-code mode: code 0 is 0,
    code c > 0 is ``lo + (c - 1) * scale``)."""
    t = np.dtype(dtype).type
    per = 8 // bits
    shifts = (np.arange(per, dtype=np.uint8) * bits).astype(np.uint8)
    code = (codes[:, None] >> shifts) & np.uint8((1 << bits) - 1)
    code = code.reshape(meta.shape[0], group_size).astype(t)
    lo, scale = meta_values(meta)
    if zero_code:
        y = lo.astype(t)[:, None] + (code - t(1)) * scale.astype(t)[:, None]
        y = np.where(code == 0, t(0), y)
    else:
        y = lo.astype(t)[:, None] + code * scale.astype(t)[:, None]
    return y.reshape(-1)[:numel]


def keep_mask(n: int, seed: int, keep: float) -> np.ndarray:
    """Dropout's keep mask of ``n`` elements for ``seed`` (bool): element ``i`` is kept when
    its 24 random bits fall below ``round(keep * 2**24)``."""
    return random24(seed, np.arange(n, dtype=np.uint64)) < np.uint64(round(keep * (1 << 24)))


def pack_columns(x: np.ndarray, bits: int, rows: int, seed: int = 0, stochastic: bool = True,
                 zero_code: bool = False, base: int = 0):
    """The column layout (:mod:`actune_kernels.cpu_columns`) of a 2-D ``[R, F]`` array:
    groups of ``rows`` rows by one feature, metadata block-major (``meta[b * F + f]``), codes
    in memory order (padding rows code 0), element ``(r, f)`` at stream index
    ``base + r * F + f``.
    Returns (codes, meta) as :func:`pack`."""
    layout.check_bits(bits)
    x = np.ascontiguousarray(x)
    total, width = x.shape
    t = x.dtype.type
    blocks = -(-total // rows)
    grid = np.zeros((blocks * rows, width), dtype=x.dtype)
    grid[:total] = x
    inside = np.broadcast_to((np.arange(blocks * rows) < total)[:, None], grid.shape)
    cube, cin = grid.reshape(blocks, rows, width), inside.reshape(blocks, rows, width)
    finite = np.where(cin, np.isfinite(cube), True).all(axis=1)
    counted = cin & (cube > 0) if zero_code else cin
    mn = np.where(counted, cube, np.inf).min(axis=1, initial=np.inf)
    mx = np.where(cin, cube, -np.inf).max(axis=1, initial=-np.inf)
    mn = np.where(finite, mn, np.nan)
    lo_word, scale_word, lo, scale = group_meta(mn.reshape(-1), mx.reshape(-1), bits, zero_code)
    levels = (1 << bits) - 1
    lo_t = lo.astype(t).reshape(blocks, 1, width)
    with np.errstate(divide="ignore", invalid="ignore"):
        inv_t = np.where(scale > 0, t(1) / scale.astype(t), t(0)).astype(t)
        v = (cube - lo_t) * inv_t.reshape(blocks, 1, width)
        floor = np.floor(v)
        frac = v - floor
    if stochastic:
        index = np.uint64(base) + np.arange(cube.size, dtype=np.uint64)
        up = random24(seed, index).reshape(cube.shape).astype(t) * t(INV_2_24) < frac
    else:
        up = frac >= t(0.5)
    base_code = 1 if zero_code else 0
    code = np.clip(np.nan_to_num(floor) + base_code + up, base_code, levels).astype(np.uint8)
    code[~cin | ~np.isfinite(lo).reshape(blocks, 1, width)] = 0
    if zero_code:
        code[~(cube > 0)] = 0
    per = 8 // bits
    shifts = (np.arange(per, dtype=np.uint8) * bits).astype(np.uint8)
    codes = (code.reshape(-1, per) << shifts).sum(axis=1, dtype=np.uint8)
    return codes.astype(np.uint8), np.stack([lo_word, scale_word], axis=1)


def unpack_columns(codes: np.ndarray, meta: np.ndarray, bits: int, total: int, width: int,
                   rows: int, dtype=np.float32, zero_code: bool = False) -> np.ndarray:
    """Dequantize :func:`pack_columns`'s output to an ``[total, width]`` array of ``dtype``."""
    t = np.dtype(dtype).type
    per = 8 // bits
    shifts = (np.arange(per, dtype=np.uint8) * bits).astype(np.uint8)
    blocks = -(-total // rows)
    code = ((codes[:, None] >> shifts) & np.uint8((1 << bits) - 1)).reshape(blocks, rows, width)
    code = code.astype(t)
    lo, scale = meta_values(meta)
    lo = lo.astype(t).reshape(blocks, 1, width)
    scale = scale.astype(t).reshape(blocks, 1, width)
    y = lo + (code - t(1) if zero_code else code) * scale
    if zero_code:
        y = np.where(code == 0, t(0), y)
    return y.reshape(-1, width)[:total]
