"""FlexAttention masks of the three NSA branches: one small module per pattern.

Each module gives a mask_mod that encodes the exact allowed set (eager flex applies only
the mask_mod, densely) and a BlockMask factory that lists the visited blocks in both
directions without materialising a [Q_LEN, KV_LEN] tensor.
"""

from nsa_flex.flex.masks.compressed import compressed_block_mask, compressed_mask_mod
from nsa_flex.flex.masks.selection import (InitialCopies, initial_copies, selection_bits, selection_block_mask,
                                     selection_mask_mod)
from nsa_flex.flex.masks.window import window_block_mask, window_mask_mod, window_widths

__all__ = [
    "compressed_block_mask",
    "compressed_mask_mod",
    "InitialCopies",
    "initial_copies",
    "selection_bits",
    "selection_block_mask",
    "selection_mask_mod",
    "window_block_mask",
    "window_widths",
    "window_mask_mod",
]
