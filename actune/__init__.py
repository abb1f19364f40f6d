"""actune: activation-compressed training for PyTorch, and an auto-tuner around it."""

from actune.quant import PackedTensor, dequantize, quantize

__version__ = "0.1.0"

__all__ = ["PackedTensor", "__version__", "dequantize", "quantize"]
