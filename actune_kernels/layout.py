"""The packed byte format shared by every implementation.

A tensor of ``numel`` elements is read in its memory order and split into groups of
``group_size`` consecutive elements; the last group is padded with zero codes. Each group
stores:

* ``meta[g, 0]``: the group's minimum ``lo``, rounded *down* onto a 16-bit float grid;
* ``meta[g, 1]``: the step ``scale`` between codes, rounded *up* onto the same grid, so that
  ``lo + scale * (2**bits - 1)`` covers the group's maximum (dequantization never clamps).
  The sign bit of this word is never needed for the (non-negative) scale and instead names
  the grid of both words: 0 = IEEE float16, 1 = bfloat16 (for groups beyond float16's range
  or precision).
* ``codes``: ``group_size * bits / 8`` bytes, element ``j`` of the group at bit offset
  ``j * bits`` (least significant bits first).

The column layout (:mod:`actune_kernels.cpu_columns`, for features-last tensors on the CPU)
uses the same words and codes with other groups: a ``[rows, features]`` tensor is cut into
blocks of ``group_size`` rows, each feature of a block is one group (``meta[block * features
+ feature]``), and the codes stay in memory order (element ``i`` at bit offset ``i * bits``).

A group holding NaN or inf, or values beyond +-2**126, stores a NaN ``lo``; it dequantizes to
NaN, so non-finite activations propagate visibly (as mixed-precision loss scaling expects)
instead of turning into silent garbage.
"""

from __future__ import annotations

SUPPORTED_BITS = (1, 2, 4, 8)
DEFAULT_GROUP_SIZE = 256

#: Flag bit in the scale word: this group's lo and scale are bfloat16, not float16.
BF16_FLAG = 0x8000
#: A float16 NaN, stored as ``lo`` for groups that hold non-finite values.
NAN16 = 0x7E00


def check_bits(bits: int) -> int:
    """Return ``bits`` if it is a supported width, else raise ``ValueError``."""
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits!r}")
    return int(bits)


def check_group_size(group_size: int) -> int:
    """Return ``group_size`` if valid (a positive multiple of 8, at most 2**16)."""
    if not isinstance(group_size, int) or group_size <= 0 or group_size % 8 or group_size > 1 << 16:
        raise ValueError(
            f"group_size must be a positive multiple of 8 and at most 65536, got {group_size!r}"
        )
    return group_size


def num_groups(numel: int, group_size: int) -> int:
    """Number of groups for ``numel`` elements (the tail group is padded)."""
    return -(-numel // group_size)


def codes_nbytes(numel: int, bits: int, group_size: int) -> int:
    """Bytes of packed codes for ``numel`` elements."""
    return num_groups(numel, group_size) * group_size * bits // 8


def packed_nbytes(numel: int, bits: int, group_size: int) -> int:
    """Every byte of a packed tensor: codes plus two 16-bit words of metadata per group."""
    return codes_nbytes(numel, bits, group_size) + 4 * num_groups(numel, group_size)
