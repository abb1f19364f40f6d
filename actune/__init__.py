"""actune: activation-compressed training for PyTorch, and an auto-tuner around it."""

from actune.autoprec.allocator import AutoPrecision
from actune.autoprec.solver import allocate
from actune.chunked_loss.linear_loss import linear_cross_entropy
from actune.chunked_loss.lm_head import chunk_loss, chunks_loss
from actune.convert import (
    autoprec_of,
    compress,
    count_compiled,
    decompress,
    is_compressed,
    stats_of,
    summary,
    track_stats,
)
from actune.families import default_level
from actune.inplace import allow_inplace_norms, disallow_inplace_norms
from actune.levels import LEVELS, Level, get_level, parse_levels
from actune.packing.batch import dequantize_many, quantize_many
from actune.packing.formats import PackedMask, PackedTensor
from actune.packing.masks import pack_mask, unpack_mask
from actune.packing.saved import DoubleBackwardError, offload_simulated
from actune.packing.tensors import dequantize, quantize
from actune.session.hooks import CompressionStats, compressed

__version__ = "0.1.0"

__all__ = [
    "LEVELS",
    "AutoPrecision",
    "CompressionStats",
    "DoubleBackwardError",
    "Level",
    "PackedMask",
    "PackedTensor",
    "__version__",
    "allocate",
    "allow_inplace_norms",
    "autoprec_of",
    "chunk_loss",
    "chunks_loss",
    "compress",
    "compressed",
    "count_compiled",
    "decompress",
    "default_level",
    "dequantize",
    "dequantize_many",
    "disallow_inplace_norms",
    "get_level",
    "is_compressed",
    "linear_cross_entropy",
    "offload_simulated",
    "pack_mask",
    "parse_levels",
    "quantize",
    "quantize_many",
    "stats_of",
    "summary",
    "track_stats",
    "unpack_mask",
]
