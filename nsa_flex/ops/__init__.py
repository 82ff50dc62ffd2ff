"""Custom ops (Triton on CUDA, a torch twin elsewhere): the streaming top-n block selection and
the fused attention of one decode token, and phi for one decode step."""

from nsa_flex.ops.decode_attend import decode_attend, decode_attend_torch
from nsa_flex.ops.phi_step import phi_step
from nsa_flex.ops.select import select_blocks, select_blocks_torch

__all__ = ["decode_attend", "decode_attend_torch", "phi_step", "select_blocks", "select_blocks_torch"]
