"""Quantization kernels for actune: one packed byte format, three implementations.

``reference`` (NumPy, the specification), ``cpu`` (Numba, parallel) and ``cuda`` (numba-cuda)
produce identical bytes for the same input and seed. Nothing here imports torch.
"""

from actune_kernels.layout import (
    DEFAULT_GROUP_SIZE,
    SUPPORTED_BITS,
    codes_nbytes,
    num_groups,
    packed_nbytes,
)

__all__ = ["DEFAULT_GROUP_SIZE", "SUPPORTED_BITS", "codes_nbytes", "num_groups", "packed_nbytes"]
