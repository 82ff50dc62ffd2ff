"""The window and selected branches with NSA's gated sum, as one autograd node: nsa_flex::gated_branches.

o = g_cmp o_cmp + g_sel o_sel + g_win o_win, with o_sel and o_win computed here (the compressed
output comes in, as cmp_rows, and its gradient goes out). One node lets the backward work from dO
itself:

- A branch's output gradient is g_b dO. Its backward needs it only through P' = g_b P (dV = P'^T dO,
  dS = P' (dO V^T - delta)), with delta = rowsum(dO o_b), the gate's gradient already. So the
  gated sum's backward writes the compressed branch's g_cmp dO (cuDNN's backward reads it), the
  gates' gradients, and for the other two branches their deltas and gates as fp32 rows laid out
  like their lse, which their kernels read as they read lse and multiply P by: the two
  [T, Hq, Dv] gradients are never written, nor delta computed again. (Read from the gates tensor
  itself, [T, Hq, 3] in 16 bits, the gates cost the kernels ~0.9 ms at g4, 64k: one gather per row.)
- The window of W >= 2 l' holds each token's two local selection blocks whole. The forward's
  window kernel stores the softmax over them (ops.window.window_and_local) and the selected op
  merges it in place of those slots, writing o_sel over that partial (folded, as o_win): no
  second [T, Hq, Dv] buffer beside it, which at G=16, 64k was the op's peak (docs/decisions.md).
  In the backward the window's kernels add the selected term over those keys, sharing the scores
  and dP (both branches see dO), and the selected backward walks the other n - 2 slots, adding
  its sums into the window's gradients in place.

Where the compressed branch is the grouped call (flex.compressed_groups), the node also runs that
call's backward (given `grouped`, the call made without a gradient of its own): right after the
gated sum's, so that its buffers (cuDNN's fp32 per-head dK / dV) come and go before the window
and selected branches' exist. As separate nodes the compressed backward ran last, beside the
others' gradients, and at G=16, 64k it was the op's peak (docs/decisions.md). The call's queries
are q's own rows, folded (from cmp_head on): the backward folds q again, call by call, and the
window's dQ kernel adds the call's dQ into q's gradient as it writes it, so the fold and that
dQ are gone before the selected backward's partials exist (the g4 op's peak at 64k).

The node reads q [B, T, Hq, Dk] in place, as the window and selected kernels take it, and its
dQ comes in that layout: no folded copy of q is kept for the backward, nor a folded gradient
unfolded after it (256 MiB each at G=4, 64k).

The node trusts its selection: every token's block_indices must list its own block and the one
before, and no block twice (the selection op's own selection with n_local = 2). So it is not public: the flex path
calls it where that holds (flex.branches.forces_local). Off the kernels (impl="torch", or off
CUDA) it runs the three ops' torch twins, which compute every slot themselves.
"""

# No `from __future__ import annotations` here: torch.library reads the ops' annotations.
from typing import TYPE_CHECKING, Optional

import torch
from torch import Tensor
from torch.library import triton_op

from nsa_flex.config import NSAConfig
from nsa_flex.folded import fold, unfold
from nsa_flex.ops.fold import fold_pairs
from nsa_flex.ops.gated_sum import _forward_impl as gated_sum_forward
from nsa_flex.ops.gated_sum import backward_deltas, check_branch_outputs
from nsa_flex.ops import window as window_op
from nsa_flex.ops.gated_sum import twin as gated_sum_twin
from nsa_flex.ops.selected_attention import _check_inputs as check_selected
from nsa_flex.ops.selected_attention import launch as selected_launch
from nsa_flex.ops.selected_attention import twin as selected_twin
from nsa_flex.ops.triton_utils import dense, quiet_without_triton
from nsa_flex.validate import is_byte_count

if TYPE_CHECKING:
    from nsa_flex.flex.compressed_groups import Grouped


def gated_branches(q: Tensor, k: Tensor, v: Tensor, block_indices: Tensor, config: NSAConfig, cmp_rows: Tensor,
                   cmp_head: int, gates: Tensor, *, scale: float | None = None, impl: str = "auto",
                   return_branches: bool = False, grouped: "Grouped | None" = None, partial_bytes: int = 0):
    """o [B, T, Hq, Dv] in q's dtype; differentiable in q, k, v, cmp_rows and gates. With
    return_branches, (o, o_sel, o_win): the branch outputs the node keeps for its backward
    (no gradient flows through them), both folded [B, Hkv, T*G, Dv] (nsa_flex::gated_sum reads
    o_sel so with sel_folded=True).

    q [B, T, Hq, Dk] (Hq = config.n_heads), read in place; k
    [B, T, Hkv, Dk], v [B, T, Hkv, Dv] (the window's keys too); block_indices [B, Hkv, T, n] listing
    each token's own selection block and the one before (see the module docstring); cmp_rows,
    cmp_head, gates as nsa_flex::gated_sum takes them. The window is config.window keys, the blocks
    config.sel_block tokens, with ops.window.local_fits(window, sel_block, Dk, Dv). impl: "auto"
    (the kernels where ops.window.kernels_apply), "triton" or "torch" (the twins). partial_bytes:
    the selected op's partial buffers per token range (its tile key; 0: its PARTIAL_BYTES).
    """
    if q.dim() == 4 and k.dim() == 4 and (q.shape[:2] != k.shape[:2] or q.shape[2] != config.n_heads):
        raise ValueError(f"gated_branches: q {tuple(q.shape)} must be [B, T, Hq, Dk] = [{k.shape[0]}, {k.shape[1]}, "
                         f"{config.n_heads}, Dk] (q itself, not folded)")
    check_selected(q, k, v, block_indices, None, impl)
    B, T, Hkv = k.shape[:3]
    G = config.n_heads // k.shape[2]
    window_op._check_inputs(q, k, v, G, config.window, impl, folded=False)
    if not window_op.local_fits(config.window, config.sel_block, q.shape[-1], v.shape[-1]):
        raise ValueError(f"gated_branches: window {config.window} and sel_block {config.sel_block} do not fit the "
                         "window kernels' local blocks (ops.window.local_fits)")
    o_win = torch.empty(B, Hkv, T * G, v.shape[-1], dtype=q.dtype, device="meta")  # the shape it will have
    check_branch_outputs(cmp_rows, cmp_head, o_win, gates, (B, T, config.n_heads, v.shape[-1]), q.dtype,
                                      window_op._runs_kernels(q, k, v, impl))
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    cmp = ()
    if grouped is not None:
        if cmp_rows.requires_grad:
            raise ValueError("gated_branches: with grouped, cmp_rows is the grouped call's output made without a "
                             "gradient (compressed_groups.compressed_grouped_detached); it needs none")
        g = grouped
        if g.q.shape[:3] != (cmp_rows.shape[0] * cmp_rows.shape[1], cmp_rows.shape[2] // g.q.shape[2], g.q.shape[2]):
            raise ValueError(f"gated_branches: grouped queries {tuple(g.q.shape)} do not match cmp_rows "
                             f"{tuple(cmp_rows.shape)} ([B*Hkv, rows / Tc, Tc, Dk])")
        # g.q is not kept: the backward folds q again (the call's queries are its rows).
        cmp = (g.k, g.v, g.lse, g.seed, g.offset, g.cudnn)
    if not is_byte_count(partial_bytes, zero=True):
        raise ValueError(f"gated_branches: partial_bytes={partial_bytes!r}; allowed: a byte count > 0, or 0 for the "
                         "selected op's default")
    o, o_sel, _, o_win, *_ = torch.ops.nsa_flex.gated_branches(q, k, v, block_indices, cmp_rows, cmp_head, gates, G,
                                                               config.window, config.sel_block, scale, impl, *cmp,
                                                               partial_bytes=partial_bytes)
    return (o, o_sel, o_win) if return_branches else o


def _no_index(q: Tensor) -> list[Tensor]:
    """The index outputs off the kernels (the twins build none): empty int32 tensors."""
    return [q.new_empty(0, dtype=torch.int32) for _ in selected_launch.SavedIndex._fields]


def _forward_impl(q: Tensor, k: Tensor, v: Tensor, block_indices: Tensor, cmp_rows: Tensor, cmp_head: int,
                  gates: Tensor, group: int, window: int, sel_block: int, scale: float,
                  impl: str, k_cmp: Optional[Tensor] = None, v_cmp: Optional[Tensor] = None,
                  lse_cmp: Optional[Tensor] = None, cmp_seed: Optional[Tensor] = None,
                  cmp_offset: Optional[Tensor] = None, cmp_cudnn: bool = False,
                  partial_bytes: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
                                                   Tensor, Tensor, Tensor]:
    """(o, o_sel (folded), lse_sel, o_win, lse_win, and the selected op's SavedIndex fields: its
    backward reuses the index instead of building it again). k_cmp ... cmp_cudnn: the Grouped
    fields but its queries (None / False without), read by the backward only. partial_bytes: as
    gated_branches'."""
    if not window_op._runs_kernels(q, k, v, impl):
        o_win, lse_win, _, _ = window_op.twin.forward(fold(q, k.shape[2]), k, v, group, window, scale)
        o_sel, lse_sel = selected_twin.forward(q, k, v, block_indices, None, scale, sel_block)
        return (gated_sum_twin.forward(cmp_rows, cmp_head, o_sel, o_win, gates), fold(o_sel, k.shape[2]), lse_sel,
                o_win, lse_win, *_no_index(q))
    cfg = window_op.launch_config(q.shape[-1], v.shape[-1])
    o_win, lse_win, o_loc, lse_loc = window_op.forward(q, k, v, group, window, scale, cfg, sel_block, folded=False)
    # o_sel is written over the local partial o_loc (folded), row by row as the merge reads it.
    o_sel, lse_sel, index = selected_launch.forward(q, k, v, block_indices, None, scale, sel_block,
                                                    _sel_tiles(partial_bytes), local=dense(o_loc, lse_loc),
                                                    keep_index=True, unique=True, into_local=True)
    o = gated_sum_forward(cmp_rows, cmp_head, o_sel, o_win, gates, "triton", True)
    return o, o_sel, lse_sel, o_win, lse_win, *index


def _backward_impl(do: Tensor, q: Tensor, k: Tensor, v: Tensor, block_indices: Tensor, cmp_rows: Tensor,
                   cmp_head: int, gates: Tensor, o_sel: Tensor, lse_sel: Tensor, o_win: Tensor, lse_win: Tensor,
                   index: list[Tensor], group: int, window: int, sel_block: int, scale: float,
                   impl: str, k_cmp: Optional[Tensor] = None, v_cmp: Optional[Tensor] = None,
                   lse_cmp: Optional[Tensor] = None, cmp_seed: Optional[Tensor] = None,
                   cmp_offset: Optional[Tensor] = None, cmp_cudnn: bool = False,
                   partial_bytes: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, d cmp_rows, d gates, and with k_cmp the grouped call's dk4, dv4; d cmp_rows is
    then empty, and without k_cmp those two are). The grouped call's queries are q's rows from
    cmp_head on, and dq holds their gradient (the window's dQ kernel adds it before its one
    rounding, so that the call's dQ is gone before the selected backward's partials exist: 256 MiB
    of the g4 op's peak at 64k, docs/decisions.md)."""
    do, = dense(do)  # once, for the three launches that read it
    if not window_op._runs_kernels(q, k, v, impl):
        T, Hkv = k.shape[1:3]
        o_sel = unfold(o_sel, T)
        d_cmp, d_sel, d_win, d_gates = gated_sum_twin.backward(do, cmp_rows, cmp_head, o_sel, o_win, gates)
        d_cmp, add, cmp_grads = _compressed_backward(d_cmp, cmp_rows, q, k_cmp, v_cmp, lse_cmp, cmp_seed, cmp_offset,
                                                     cmp_cudnn, scale, cmp_head)
        dqw, dk, dv = window_op.twin.backward(d_win, fold(q, Hkv), k, v, group, window, scale)
        dqs, dks, dvs = selected_twin.backward(d_sel, q, k, v, o_sel, lse_sel, block_indices, None, scale, sel_block)
        rows = _cmp_rows_end(q, cmp_rows, cmp_head, add is not None)
        dqw = _with_rows(torch.nn.functional.pad(dqw, (0, 0, 0, rows - dqw.shape[2])), add)
        return unfold(dqw[:, :, :T * group], T) + dqs, dk + dks, dv + dvs, d_cmp, d_gates, *cmp_grads
    d_cmp, d_gates, delta_sel, delta_win, gate_sel, gate_win = backward_deltas(
        do, cmp_rows, cmp_head, o_sel, o_win, gates, cmp_apart=_cmp_apart(cmp_rows, k_cmp), sel_folded=True)
    d_cmp, add, cmp_grads = _compressed_backward(d_cmp, cmp_rows, q, k_cmp, v_cmp, lse_cmp, cmp_seed, cmp_offset,
                                                 cmp_cudnn, scale, cmp_head)
    cfg = window_op.launch_config(q.shape[-1], v.shape[-1])
    grads = window_op.backward(do, q, k, v, o_win, lse_win, group, window, scale, cfg, gate=gate_win, delta=delta_win,
                               sel=(lse_sel, delta_sel, gate_sel, sel_block), add=add, folded=False)
    del add  # the grouped call's dQ, in grads[0] now
    dq, dk, dv = selected_launch.backward(do, q, k, v, o_sel, lse_sel, block_indices, None, scale, sel_block,
                                          _sel_tiles(partial_bytes), gate=gate_sel, delta=delta_sel,
                                          skip_local=True, acc=grads, index=selected_launch.SavedIndex(*index))
    return dq, dk, dv, d_cmp, d_gates, *cmp_grads


def _sel_tiles(partial_bytes: int) -> dict:
    """The selected op's tiles: its defaults, with partial_bytes as its partial budget (0: its own)."""
    return {"partial_bytes": partial_bytes}


def _cmp_apart(cmp_rows: Tensor, k_cmp) -> bool:
    """Whether the grouped call's output gradient d cmp_rows comes in a launch of its own, once
    o_sel and o_win are gone (gated_sum.backward_deltas' cmp_apart: one more read of dO).

    With the grouped call that gradient is consumed here, by the call's backward, which runs next
    (its buffers are gone before the window's and selected's exist). Beside q, o, o_cmp and it,
    the deltas' launch holds o_sel and o_win, the call's backward its dQ, one call's folded rows
    and at most CUDNN_BACKWARD_BYTES: the first is the larger moment where d cmp_rows (about as
    large as each [T, Hq, Dv]) is larger than that bound (at G=16, 64k: 1 GiB against 256 MiB), and
    there it was the op's peak (docs/decisions.md)."""
    if k_cmp is None:
        return False
    from nsa_flex.flex.compressed_groups import CUDNN_BACKWARD_BYTES

    return cmp_rows.numel() * cmp_rows.element_size() > CUDNN_BACKWARD_BYTES


def _compressed_backward(d_cmp: Tensor, cmp_rows: Tensor, q: Tensor, k_cmp, v_cmp, lse_cmp, cmp_seed, cmp_offset,
                         cmp_cudnn: bool, scale: float, cmp_head: int):
    """(d cmp_rows, add, (dk4, dv4)). Without the grouped call (k_cmp None): d_cmp, None and two
    empty tensors. With it, an empty d cmp_rows, the call's dQ as q's rows to add (window
    backward's `add`: its parts from cmp_head on) and the call's dk4, dv4. The call's queries are
    q folded again here (nsa_flex::fold_pairs' kernel on CUDA), for each cuDNN call only the
    (batch, kv head) rows it reads, gone once that call is done: at G=4, 64k one row's 64 MiB
    instead of the whole 256 MiB beside cuDNN's buffers (docs/decisions.md)."""
    empty = lambda: d_cmp.new_empty(0)  # noqa: E731 (a tensor each: an op's outputs may not alias)
    if k_cmp is None:
        return d_cmp, None, (empty(), empty())
    # flex imports this module: the grouped call's code comes at call time.
    from nsa_flex.flex.compressed_groups import grouped_backward, to_grouped

    Tc, Hkv, n = k_cmp.shape[2], cmp_rows.shape[1], cmp_rows.shape[2]
    end = _cmp_rows_end(q, cmp_rows, cmp_head, grouped=True)

    def queries(first: int, count: int) -> Tensor:
        """The call's queries [count, d*G, Tc, Dk] of (batch, kv head) rows first .. first + count - 1."""
        return to_grouped(fold_pairs(q, Hkv, end, first, count)[None, :, cmp_head:cmp_head + n], Tc)

    parts, dk4, dv4 = grouped_backward(to_grouped(d_cmp, Tc), to_grouped(cmp_rows, Tc), queries, k_cmp, v_cmp,
                                       lse_cmp, cmp_seed, cmp_offset, cmp_cudnn, scale, dq_parts=True)
    return empty(), (parts, cmp_head), (dk4, dv4)


def _cmp_rows_end(q: Tensor, cmp_rows: Tensor, cmp_head: int, grouped: bool) -> int:
    """Folded rows a kv head: q's T*G, and with the grouped call also its rows past T*G (padding)."""
    rows = q.shape[1] * (q.shape[2] // cmp_rows.shape[1])
    return max(rows, cmp_head + cmp_rows.shape[2]) if grouped else rows


def _with_rows(dq: Tensor, add) -> Tensor:
    """dq [B, Hkv, R, Dk] folded with add's rows added (window backward's `add`; None: dq)."""
    if add is None:
        return dq
    from nsa_flex.flex.compressed_groups import from_grouped

    parts, head = add
    B, Hkv, R, D = dq.shape
    flat = dq.reshape(B * Hkv, R, D).clone()
    for bh0, x in parts:
        rows = from_grouped(x)
        flat[bh0:bh0 + rows.shape[0], head:head + rows.shape[1]] += rows.to(dq.dtype)
    return flat.view(B, Hkv, R, D)


with quiet_without_triton():
    _forward_op = triton_op("nsa_flex::gated_branches", mutates_args=())(_forward_impl)
    _backward_op = triton_op("nsa_flex::gated_branches_backward", mutates_args=())(_backward_impl)


@_forward_op.register_fake
def _forward_fake(q, k, v, block_indices, cmp_rows, cmp_head, gates, group, window, sel_block, scale, impl, k_cmp=None,
                  v_cmp=None, lse_cmp=None, cmp_seed=None, cmp_offset=None, cmp_cudnn=False, partial_bytes=0):
    B, T, Hkv, _ = k.shape
    Hq, Dv = Hkv * group, v.shape[-1]
    if window_op._runs_kernels(q, k, v, impl):
        shapes = selected_launch.saved_index_shapes(B, T, Hkv, block_indices.shape[-1], sel_block, q, k, v,
                                                    tiles=_sel_tiles(partial_bytes), skip_local=True)
        index = [q.new_empty(shape, dtype=torch.int32) for shape in shapes]
    else:
        index = _no_index(q)
    return (q.new_empty(B, T, Hq, Dv), q.new_empty(B, Hkv, T * group, Dv), q.new_empty(B, Hq, T, dtype=torch.float32),
            q.new_empty(B, Hkv, T * group, Dv), q.new_empty(B, Hkv, T * group, dtype=torch.float32), *index)


@_backward_op.register_fake
def _backward_fake(do, q, k, v, block_indices, cmp_rows, cmp_head, gates, o_sel, lse_sel, o_win, lse_win, index,
                   group, window, sel_block, scale, impl, k_cmp=None, v_cmp=None, lse_cmp=None, cmp_seed=None,
                   cmp_offset=None, cmp_cudnn=False, partial_bytes=0):
    grads = (torch.empty_like(q, memory_format=torch.contiguous_format), torch.empty_like(k), torch.empty_like(v))
    d_gates = torch.empty_like(gates, memory_format=torch.contiguous_format)
    if k_cmp is None:
        return (*grads, torch.empty_like(cmp_rows, memory_format=torch.contiguous_format), d_gates,
                *(cmp_rows.new_empty(0) for _ in range(2)))
    return (*grads, cmp_rows.new_empty(0), d_gates, torch.empty_like(k_cmp, memory_format=torch.contiguous_format),
            torch.empty_like(v_cmp, memory_format=torch.contiguous_format))


def _setup_context(ctx, inputs, output):
    # inputs hold every argument, the defaults of those not given (None / False) included.
    (q, k, v, block_indices, cmp_rows, cmp_head, gates, group, window, sel_block, scale, impl, k_cmp, v_cmp,
     lse_cmp, cmp_seed, cmp_offset, cmp_cudnn, partial_bytes) = inputs
    _, o_sel, lse_sel, o_win, lse_win, *index = output
    ctx.mark_non_differentiable(o_sel, lse_sel, o_win, lse_win, *index)
    ctx.save_for_backward(q, k, v, block_indices, cmp_rows, gates, o_sel, lse_sel, o_win, lse_win, k_cmp, v_cmp,
                          lse_cmp, cmp_seed, cmp_offset, *index)
    ctx.args = (cmp_head, group, window, sel_block, scale, impl)
    ctx.cmp_cudnn, ctx.partial_bytes = cmp_cudnn, partial_bytes


def _backward(ctx, do, _do_sel, _dlse_sel, _do_win, _dlse_win, *_d_index):
    q, k, v, block_indices, cmp_rows, gates, o_sel, lse_sel, o_win, lse_win, *cmp_index = ctx.saved_tensors
    cmp, index = cmp_index[:5], cmp_index[5:]
    cmp_head, *rest = ctx.args
    dq, dk, dv, d_cmp, d_gates, dk_cmp, dv_cmp = torch.ops.nsa_flex.gated_branches_backward(
        do, q, k, v, block_indices, cmp_rows, cmp_head, gates, o_sel, lse_sel, o_win, lse_win, index, *rest, *cmp,
        ctx.cmp_cudnn, ctx.partial_bytes)
    if cmp[0] is None:  # no grouped call: cmp_rows takes its gradient
        return dq, dk, dv, None, d_cmp, None, d_gates, *[None] * 12
    # The grouped call's queries are q's rows: dq holds their gradient.
    return dq, dk, dv, None, None, None, d_gates, None, None, None, None, None, dk_cmp, dv_cmp, *[None] * 5


_forward_op.register_autograd(_backward, setup_context=_setup_context)
