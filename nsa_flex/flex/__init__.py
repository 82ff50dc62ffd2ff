"""The FlexAttention path: the three branches as Flex calls, their BlockMasks, and the tiles.

`branches` runs the op (compressed call with lse -> selection op -> selected call -> window
call -> gated sum; without gradients the window call comes before the selected op, whose merge
takes the gated sum), `compressed_groups` the compressed branch as one causal cuDNN call over
token groups (CUDA, 16-bit), `masks/` builds one BlockMask per pattern, `blockmask` emits BlockMask
index lists without a dense [Q, KV] grid, `tuning` holds the tile sizes and
`inductor_choices` the process-global Inductor settings the selected branch's backward needs.
"""

from nsa_flex.flex.branches import (SelectedKeys, compressed_branch, gated_sum, nsa_flex, nsa_flex_branches,
                                    selected_branch, selected_keys, shape_mask, window_branch,
                                    with_initial_copies)
from nsa_flex.folded import FoldedRows, fold, unfold
from nsa_flex.flex.tuning import FlexTiles

__all__ = ["FlexTiles", "FoldedRows", "SelectedKeys", "compressed_branch", "fold", "gated_sum", "nsa_flex",
           "nsa_flex_branches", "selected_branch", "selected_keys", "shape_mask", "unfold", "window_branch",
           "with_initial_copies"]
