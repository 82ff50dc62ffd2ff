"""Custom ops: the streaming top-n block selection (Triton on CUDA, a torch twin elsewhere)."""

from nsa_flex.ops.select import select_blocks, select_blocks_torch

__all__ = ["select_blocks", "select_blocks_torch"]
