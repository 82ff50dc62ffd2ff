"""The window and selected branches in one op, sharing each token's two local blocks:
nsa_flex::window_selected_attention.

The window of W >= 2 l' keys holds the selected branch's local blocks whole (a token's own
selection block, causally, and the one before). Forward: the window kernel stores the softmax
over those keys on its way (ops.window.window_and_local), and the selected op merges that
partial in place of the two slots. Backward: the window's dQ and dK/dV kernels add the selected
branch's term over those keys, whose scores they compute anyway, and the selected op's backward
walks the other n - 2 slots, adding its sums to the window's gradients in place. So the local
slots cost neither kernel a second load of their query rows nor a dQ partial per slot.

The op trusts its selection: every token's block_indices must list its own block and the one
before (the selection op's own selection with n_local = 2); a selection without them would give
wrong results. So it is not public: the flex path calls it where that holds
(flex.branches._forces_local). On the torch twins (impl="torch", or off CUDA) it is the two ops'
twins, which compute every slot themselves.
"""

# No `from __future__ import annotations` here: torch.library reads the ops' annotations.
import math

import torch
from torch import Tensor
from torch.library import triton_op

from nsa_flex.config import NSAConfig
from nsa_flex.folded import fold
from nsa_flex.ops import window as window_op
from nsa_flex.ops.selected_attention import launch as selected_launch
from nsa_flex.ops.selected_attention import twin as selected_twin
from nsa_flex.ops.selected_attention import _check_inputs as check_selected
from nsa_flex.ops.selected_attention import _unfolded
from nsa_flex.ops.triton_utils import dense, quiet_without_triton


def window_selected(q: Tensor, k: Tensor, v: Tensor, block_indices: Tensor, config: NSAConfig, *,
                    scale: float | None = None, impl: str = "auto") -> tuple[Tensor, Tensor]:
    """(o_win [B, Hkv, T*G, Dv] folded, o_sel [B, T, Hq, Dv]) in q's dtype; differentiable in q, k, v.

    q [B, Hkv, R >= T*G, Dk] folded (nsa_flex.folded, Hq = config.n_heads), read in place by both
    branches; k [B, T, Hkv, Dk], v [B, T, Hkv, Dv]; block_indices [B, Hkv, T, n] listing each
    token's own selection block and the one before (see the module docstring). The window is
    config.window keys, the blocks config.sel_block tokens, with
    ops.window.local_fits(window, sel_block, Dk, Dv). impl: "auto" (the kernels where
    ops.window.kernels_apply), "triton" or "torch" (the twins).
    """
    check_selected(q, k, v, block_indices, None, impl, config.n_heads)
    G = config.n_heads // k.shape[2]
    window_op._check_inputs(q, k, v, G, config.window, impl)
    if not window_op.local_fits(config.window, config.sel_block, q.shape[-1], v.shape[-1]):
        raise ValueError(f"window_selected: window {config.window} and sel_block {config.sel_block} do not fit "
                         "the window kernels' local partial (ops.window.local_fits)")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    o_win, _, o_sel, _ = torch.ops.nsa_flex.window_selected_attention(q, k, v, block_indices, G, config.window,
                                                                      config.sel_block, scale, impl)
    return o_win, o_sel


def _runs_kernels(q: Tensor, k: Tensor, v: Tensor, impl: str) -> bool:
    return window_op._runs_kernels(q, k, v, impl)


def _forward_impl(q: Tensor, k: Tensor, v: Tensor, block_indices: Tensor, group: int, window: int, sel_block: int,
                  scale: float, impl: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    q_heads = group * k.shape[2]
    if not _runs_kernels(q, k, v, impl):
        o_win, lse_win, _, _ = window_op.twin.forward(q, k, v, group, window, scale)
        o_sel, lse_sel = selected_twin.forward(_unfolded(q, k, q_heads), k, v, block_indices, None, scale, sel_block)
        return o_win, lse_win, o_sel, lse_sel
    cfg = window_op.launch_config(q.shape[-1], v.shape[-1])
    o_win, lse_win, o_loc, lse_loc = window_op.forward(q, k, v, group, window, scale, cfg, sel_block)
    o_sel, lse_sel = selected_launch.forward(q, k, v, block_indices, None, scale, sel_block, q_heads=q_heads,
                                             local=dense(o_loc, lse_loc))
    return o_win, lse_win, o_sel, lse_sel


def _backward_impl(do_win: Tensor, do_sel: Tensor, q: Tensor, k: Tensor, v: Tensor, o_win: Tensor, lse_win: Tensor,
                   o_sel: Tensor, lse_sel: Tensor, block_indices: Tensor, group: int, window: int, sel_block: int,
                   scale: float, impl: str) -> tuple[Tensor, Tensor, Tensor]:
    q_heads = group * k.shape[2]
    if not _runs_kernels(q, k, v, impl):
        dq, dk, dv = window_op.twin.backward(do_win, q, k, v, group, window, scale)
        dqs, dks, dvs = selected_twin.backward(do_sel, _unfolded(q, k, q_heads), k, v, o_sel, lse_sel, block_indices,
                                               None, scale, sel_block)
        return dq + fold(dqs, k.shape[2], rows=q.shape[2]), dk + dks, dv + dvs
    cfg = window_op.launch_config(q.shape[-1], v.shape[-1])
    do_sel, o_sel = dense(do_sel, o_sel)
    delta_sel = selected_launch._delta(do_sel, o_sel)
    grads = window_op.backward(do_win, q, k, v, o_win, lse_win, group, window, scale, cfg,
                               sel=(do_sel, lse_sel, delta_sel, sel_block))
    return selected_launch.backward(do_sel, q, k, v, o_sel, lse_sel, block_indices, None, scale, sel_block,
                                    q_heads=q_heads, delta=delta_sel, skip_local=True, acc=grads)


with quiet_without_triton():
    _forward_op = triton_op("nsa_flex::window_selected_attention", mutates_args=())(_forward_impl)
    _backward_op = triton_op("nsa_flex::window_selected_attention_backward", mutates_args=())(_backward_impl)


@_forward_op.register_fake
def _forward_fake(q, k, v, block_indices, group, window, sel_block, scale, impl):
    B, T, Hkv, _ = k.shape
    Dv = v.shape[-1]
    return (q.new_empty(B, Hkv, T * group, Dv), q.new_empty(B, Hkv, T * group, dtype=torch.float32),
            q.new_empty(B, T, Hkv * group, Dv), q.new_empty(B, Hkv * group, T, dtype=torch.float32))


@_backward_op.register_fake
def _backward_fake(do_win, do_sel, q, k, v, o_win, lse_win, o_sel, lse_sel, block_indices, group, window, sel_block,
                   scale, impl):
    return (torch.empty_like(q, memory_format=torch.contiguous_format), torch.empty_like(k), torch.empty_like(v))


def _setup_context(ctx, inputs, output):
    q, k, v, block_indices, group, window, sel_block, scale, impl = inputs
    o_win, lse_win, o_sel, lse_sel = output
    ctx.mark_non_differentiable(lse_win, lse_sel)
    ctx.save_for_backward(q, k, v, o_win, lse_win, o_sel, lse_sel, block_indices)
    ctx.args = (group, window, sel_block, scale, impl)


def _backward(ctx, do_win, _dlse_win, do_sel, _dlse_sel):
    q, k, v, o_win, lse_win, o_sel, lse_sel, block_indices = ctx.saved_tensors
    # An output that took no part in the loss gets no gradient: its branch then adds nothing.
    do_win = torch.zeros_like(o_win) if do_win is None else do_win
    do_sel = torch.zeros_like(o_sel) if do_sel is None else do_sel
    dq, dk, dv = torch.ops.nsa_flex.window_selected_attention_backward(do_win, do_sel, q, k, v, o_win, lse_win, o_sel,
                                                                       lse_sel, block_indices, *ctx.args)
    return dq, dk, dv, None, None, None, None, None, None


_forward_op.register_autograd(_backward, setup_context=_setup_context)
