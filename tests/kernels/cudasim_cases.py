"""Run under NUMBA_ENABLE_CUDASIM=1 (set before numba is imported) by test_cuda.py: packs small
arrays with the CUDA kernels in numba-cuda's simulator and compares them with the reference
byte for byte. Prints one line per case; exits 1 on the first mismatch."""

import os
import sys

import numpy as np

assert os.environ.get("NUMBA_ENABLE_CUDASIM") == "1", "run with NUMBA_ENABLE_CUDASIM=1"

from actune_kernels import cuda as kernels  # noqa: E402
from actune_kernels import layout  # noqa: E402
from actune_kernels import reference as ref  # noqa: E402

CASES = [
    # (bits, dtype, numel, group_size, stochastic, base, zero_code)
    (1, np.float32, 200, 64, True, 0, False),
    (2, np.float32, 300, 64, True, 0, False),
    (2, np.float32, 300, 64, False, 0, False),
    (4, np.float64, 130, 32, True, 0, False),
    (8, np.float32, 100, 64, True, 0, False),
    (2, np.float32, 256, 64, True, 2**32 - 100, False),  # a group crosses a 2**32 stream boundary
    (2, np.float32, 128, 64, True, 2**33 + 7, False),
    (2, np.float32, 200, 64, True, 0, True),  # zero-code mode (ReLU outputs)
    (2, np.float32, 260, 40, True, 0, False),  # groups that are not whole rows of a warp
    (4, np.float32, 600, 256, True, 5, False),  # the default group size, a tail group
    (2, np.float64, 300, 8, True, 0, True),  # one byte per group row: lanes past the group
]
#: Cases run again with one block a launch: the warps loop over the groups.
ONE_BLOCK = [(2, np.float32, 700, 64, True, 2**32 - 300, False),
             (1, np.float32, 300, 16, False, 0, False)]


#: Several tensors in one launch: (group size, [(numel, bits, zero_code), ...]); blocks mix
#: widths, one segment is empty, the second case runs in one block (warps loop).
SEGMENT_CASES = [
    (64, [(200, 2, False), (0, 8, False), (70, 1, False), (300, 4, True), (5, 8, False)]),
    (32, [(100, 8, True), (33, 2, False), (64, 1, False)]),
]


def segments_same(rng, group_size, specs, one_block) -> bool:
    from actune_kernels import cpu_segments

    kernels.MAX_BLOCKS = 1 if one_block else 8192
    parts = []
    for n, _, zero in specs:
        x = (rng.standard_normal(n) * 3).astype(np.float32)
        parts.append(np.maximum(x, 0) if zero else x)
    x = np.concatenate(parts)
    table = cpu_segments.segment_table([n for n, _, _ in specs], [b for _, b, _ in specs],
                                       [z for _, _, z in specs], group_size)
    start, group, codes_at = table[:3]
    codes = np.full(int(codes_at[-1]), 0xAA, np.uint8)
    meta = np.full((int(group[-1]), 2), 0xAAAA, np.uint16)
    kernels.pack_segments(x, codes, meta, table, group_size, 13)
    y = np.full(x.size, 7, np.float32)
    kernels.unpack_segments(codes, meta, table, group_size, y)
    for k, (_, b, z) in enumerate(specs):
        seg = x[start[k]:start[k + 1]]
        c_ref, m_ref = ref.pack(seg, b, group_size, 13, True, int(start[k]), z)
        y_ref = ref.unpack(c_ref, m_ref, b, seg.size, group_size, np.float32, z)
        if not (np.array_equal(codes[codes_at[k]:codes_at[k + 1]], c_ref)
                and np.array_equal(meta[group[k]:group[k + 1]], m_ref)
                and np.array_equal(y[start[k]:start[k + 1]].view(np.uint8),
                                   y_ref.view(np.uint8))):
            return False
    return True


def main() -> int:
    rng = np.random.default_rng(0)
    for i, (group_size, specs) in enumerate(SEGMENT_CASES):
        same = segments_same(rng, group_size, specs, one_block=i == 1)
        print(f"segments group={group_size} {specs} one_block={i == 1} same={same}")
        if not same:
            return 1
    for case in CASES + ONE_BLOCK:
        bits, dtype, n, gs, stochastic, base, zero_code = case
        kernels.MAX_BLOCKS = 1 if case in ONE_BLOCK else 8192
        x = (rng.standard_normal(n) * 3).astype(dtype)
        x[: min(n, 40)] = 0.5  # a constant run
        if zero_code:
            x = np.maximum(x, 0)
            x[64:128] = 0  # a group of zeros
        elif n > 150:
            x[140] = np.nan  # a non-finite group
        codes_ref, meta_ref = ref.pack(x, bits, gs, 11, stochastic, base, zero_code)
        codes = np.full_like(codes_ref, 0xAA)
        meta = np.full_like(meta_ref, 0xAAAA)
        kernels.pack(x, codes, meta, bits, gs, 11, base, stochastic, zero_code)
        y_ref = ref.unpack(codes_ref, meta_ref, bits, n, gs, dtype, zero_code)
        y = np.full(n, 7, dtype)
        kernels.unpack(codes_ref, meta_ref, bits, gs, y, zero_code)
        same = (
            np.array_equal(codes, codes_ref)
            and np.array_equal(meta, meta_ref)
            and np.array_equal(y.view(np.uint8), y_ref.view(np.uint8))
        )
        print(f"bits={bits} dtype={np.dtype(dtype).name} n={n} group={gs} "
              f"stochastic={stochastic} base={base} zero_code={zero_code} "
              f"groups={layout.num_groups(n, gs)} blocks={kernels.grid(len(meta))[0]} "
              f"same={same}")
        if not same:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
