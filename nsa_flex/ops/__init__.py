"""Custom ops (Triton on CUDA, a torch twin elsewhere): the streaming top-n block selection and
the fused attention of one decode token, phi for one decode step, and the cache update of one
decode step (token writes and phi in one launch), and the two together as one decode step;
the block-centric selected branch of training and prefill (selected_attention)."""

from nsa_flex.ops.cache_step import cache_step
from nsa_flex.ops.decode_attend import decode_attend, decode_attend_torch
from nsa_flex.ops.phi_step import phi_step
from nsa_flex.ops.select import select_blocks, select_blocks_torch
from nsa_flex.ops.selected_attention import selected_attention
from nsa_flex.ops.step_attend import step_attend

__all__ = ["cache_step", "decode_attend", "decode_attend_torch", "phi_step", "select_blocks", "select_blocks_torch",
           "selected_attention", "step_attend"]
