"""nsa-flex: Native Sparse Attention for PyTorch, compiler-first."""

from nsa_flex.attention import IMPLS, Gate, NSAAttention, nsa_attention
from nsa_flex.compression import Compressor
from nsa_flex.config import PRESETS, NSAConfig

__version__ = "0.1.0"

__all__ = ["IMPLS", "PRESETS", "Compressor", "Gate", "NSAAttention", "NSAConfig", "nsa_attention", "__version__"]
