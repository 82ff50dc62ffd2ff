"""Custom ops, one folder each: the registration and its torch twin beside the Triton kernels.

- `select/`: nsa_flex::select_blocks, the streaming top-n block selection of a whole sequence.
- `selected_attention/`: nsa_flex::selected_attention, the selected branch, block-centric; and
  nsa_flex::selected_gated_sum, its forward with the gated sum as the merge's epilogue (no backward).
- `window/`: nsa_flex::window_attention, the sliding window over folded queries (kernels for its band).
- `gated_sum/`: nsa_flex::gated_sum, the branches' gated sum read from the layouts they leave.
- `gated_branches`: nsa_flex::gated_branches, the window and selected branches with the gated sum as
  one autograd node (the flex path's, with gradients), its backward working from dO and the gates.
- `fold/`: nsa_flex::fold, the folded queries as one buffer for every call that reads them.
- `decode/`: one decode step: the cache update (cache_step, with phi_step for completed blocks)
  and the fused attention of one token (decode_attend), both in one op (step_attend).
- `triton_utils`: Triton helpers shared by several ops.
- `capped_launch`: launches with a register cap, through an op opaque to Inductor (which would
  drop the cap).
"""

from nsa_flex.ops.decode.attend import decode_attend, decode_attend_torch
from nsa_flex.ops.decode.cache_step import cache_step
from nsa_flex.ops.decode.phi_step import phi_step
from nsa_flex.ops.decode.step_attend import step_attend
from nsa_flex.ops.fold import fold
from nsa_flex.ops.gated_sum import gated_sum
from nsa_flex.ops.select.op import select_blocks, select_blocks_torch
from nsa_flex.ops.selected_attention import selected_attention, selected_gated_sum
from nsa_flex.ops.window import window_attention

__all__ = ["cache_step", "decode_attend", "decode_attend_torch", "fold", "gated_sum", "phi_step", "select_blocks",
           "select_blocks_torch", "selected_attention", "selected_gated_sum",
           "step_attend", "window_attention"]
