"""NSA's selected branch, block-centric: the op nsa_flex::selected_attention.

Query t (query head hq, kv head h = hq // G) attends to the keys s <= t of the selection blocks
listed in block_indices[b, h, t, :] (block j = tokens [j l', (j+1) l'), -1 unused), softmax
with scale Dk ** -0.5 by default; a row with no key gives 0. This is the reference's selected
branch (nsa_flex.reference: _selection_mask, _attend).

At small GQA groups the token-centric loop (each query tile walks its n blocks) reads every
block's K/V once per query tile, so it is bound by K/V traffic. Here a program takes one key
block and a span of the tokens that selected it (FSA, arXiv 2508.18224): K/V are read once
per span, the traffic per (token, block) is the G query rows plus a partial output in the
inputs' dtype (kernels.py); long sequences run in token ranges that bound those partials. The inverse index and the work list (index.py) come from shapes-only sizes,
so the op traces under torch.compile(fullgraph=True) and CUDA graphs.

nsa_flex::selected_gated_sum is the forward alone with nsa_flex::gated_sum as the slot merge's
epilogue, for calls without gradients (the flex path's inference order).

On CUDA the op runs the Triton kernels; elsewhere, or without Triton, the torch twin (twin.py).
The choice is made inside the op body (a register_kernel("cpu") fallback would be skipped
under torch.compile). impl="triton" forces the kernels, e.g. on CPU tensors under Triton's
interpreter in tests.
"""

# No `from __future__ import annotations` here: torch.library reads the ops' annotations.
from typing import Optional

import torch
from torch import Tensor
from torch.library import triton_op

from nsa_flex.config import NSAConfig
from nsa_flex.folded import fold, unfold
from nsa_flex.ops.gated_sum import check_branch_outputs
from nsa_flex.ops.gated_sum import twin as gated_sum_twin
from nsa_flex.ops.selected_attention import launch, twin
from nsa_flex.ops.triton_utils import dense, quiet_without_triton, runs_triton
from nsa_flex.validate import check_4d, needs_grad

_IMPLS = ("auto", "triton", "torch")
_KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def selected_attention(q: Tensor, k: Tensor, v: Tensor, block_indices: Tensor, config: NSAConfig, *,
                       scale: float | None = None, cu_seqlens: Tensor | None = None, impl: str = "auto",
                       folded: bool = False) -> Tensor:
    """o [B,T,Hq,Dv] in q's dtype; differentiable in q, k, v.

    q [B,T,Hq,Dk], or with folded=True q [B,Hkv,R,Dk] in the folded layout (nsa_flex.folded; R >= T*G
    rows, those past T*G ignored, Hq = config.n_heads), read in place: the Flex and cuDNN calls keep
    that copy of q for their backward, so the op keeps no second one. k [B,T,Hkv,Dk], v [B,T,Hkv,Dv]
    (one dtype), block_indices [B,Hkv,T,n] int32/int64
    (-1 unused; ascending as the selection op gives them, though order does not matter; a block
    listed twice in a row counts once, as in the reference's mask). Blocks are config.sel_block tokens. cu_seqlens [n_docs+1] (B == 1): packed
    documents with document-local block ids. impl: "auto" (Triton on CUDA, else the twin),
    "triton" (the kernels on any device: CPU only under TRITON_INTERPRET=1) or "torch" (the twin).
    """
    return _attend(q, k, v, block_indices, config, scale, cu_seqlens, impl, folded, None)


def _with_window_local(q: Tensor, k: Tensor, v: Tensor, block_indices: Tensor, config: NSAConfig,
                       local: tuple[Tensor, Tensor], *, scale: float | None = None, impl: str = "auto",
                       folded: bool = False) -> Tensor:
    """selected_attention whose forward takes the window op's partial over the local blocks.

    Not public: it trusts what it is given. local is (o_loc, lse_loc) as ops.window.window_and_local
    gave them for these q, k, v, scale and config.sel_block, and block_indices lists each token's
    own selection block and the one before (the selection op's own selection with n_local = 2).
    The forward's kernels merge the partial in place of the slots listing those blocks, which they
    skip; the twin and the backward compute those slots themselves (the same values). A partial of
    other inputs, or a selection without those blocks, would give a wrong forward: the flex path
    calls this only where both hold (flex.branches.forces_local).
    """
    return _attend(q, k, v, block_indices, config, scale, None, impl, folded, local)


def _attend(q, k, v, block_indices, config: NSAConfig, scale, cu_seqlens, impl: str, folded: bool,
            local) -> Tensor:
    q_heads = config.n_heads if folded else 0
    _check_inputs(q, k, v, block_indices, cu_seqlens, impl, q_heads)
    o_loc, lse_loc = _check_local(local, k, v, launch.query_heads(q, q_heads))
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    o, _ = torch.ops.nsa_flex.selected_attention(q, k, v, block_indices, cu_seqlens, scale, config.sel_block, impl,
                                                 q_heads, o_loc, lse_loc)
    return o


def selected_gated_sum(q: Tensor, k: Tensor, v: Tensor, block_indices: Tensor, config: NSAConfig, cmp_rows: Tensor,
                       cmp_head: int, o_win: Tensor, gates: Tensor, *, scale: float | None = None,
                       cu_seqlens: Tensor | None = None, impl: str = "auto", folded: bool = False) -> Tensor:
    """NSA's output o = g_cmp o_cmp + g_sel o_sel + g_win o_win [B,T,Hq,Dv] in q's dtype, without gradients.

    The selected branch (arguments as selected_attention) with nsa_flex::gated_sum (cmp_rows,
    cmp_head, o_win, gates as that op takes them) as the epilogue of its slot merge: o_sel is
    never written to memory and read back. The same values as gated_sum(..., selected_attention(...),
    ...): o_sel is rounded to q's dtype before the sum, as that op's output is. No backward: call it
    where no input needs a gradient (inference); training keeps o_sel for the gates' backward.
    """
    return _gated(q, k, v, block_indices, config, cmp_rows, cmp_head, o_win, gates, scale, cu_seqlens, impl, folded,
                  None)


def _gated_with_window_local(q: Tensor, k: Tensor, v: Tensor, block_indices: Tensor, config: NSAConfig,
                             cmp_rows: Tensor, cmp_head: int, o_win: Tensor, gates: Tensor,
                             local: tuple[Tensor, Tensor], *, scale: float | None = None, impl: str = "auto",
                             folded: bool = False) -> Tensor:
    """selected_gated_sum with the window op's local partial; not public, for what it trusts see
    _with_window_local."""
    return _gated(q, k, v, block_indices, config, cmp_rows, cmp_head, o_win, gates, scale, None, impl, folded, local)


def _gated(q, k, v, block_indices, config: NSAConfig, cmp_rows, cmp_head: int, o_win, gates, scale, cu_seqlens,
           impl: str, folded: bool, local) -> Tensor:
    if needs_grad(q, k, v, cmp_rows, o_win, gates):
        raise RuntimeError("selected_gated_sum has no backward: call it under torch.no_grad() or "
                           "torch.inference_mode(), or use selected_attention and gated_sum for gradients")
    q_heads = config.n_heads if folded else 0
    _check_inputs(q, k, v, block_indices, cu_seqlens, impl, q_heads)
    check_4d({"q": (q, "q"), "cmp_rows": (cmp_rows, "[B, Hkv, R, Dv]"), "o_win": (o_win, "[B, Hkv, T*G, Dv]"),
              "gates": (gates, "[B, T, Hq, 3]")}, "q")
    B, T = k.shape[:2]
    out_shape = (B, T, launch.query_heads(q, q_heads), v.shape[-1])
    check_branch_outputs(cmp_rows, cmp_head, o_win, gates, out_shape, q.dtype, runs_triton(q, impl))
    o_loc, lse_loc = _check_local(local, k, v, out_shape[2])
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return torch.ops.nsa_flex.selected_gated_sum(q, k, v, block_indices, cu_seqlens, scale, config.sel_block, impl,
                                                 q_heads, cmp_rows, cmp_head, o_win, gates, o_loc, lse_loc)


def _forward_impl(q: Tensor, k: Tensor, v: Tensor, block_indices: Tensor, cu_seqlens: Optional[Tensor],
                  scale: float, sel_block: int, impl: str, q_heads: int, o_loc: Optional[Tensor],
                  lse_loc: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    if runs_triton(q, impl):
        return launch.forward(q, k, v, block_indices, cu_seqlens, scale, sel_block, q_heads=q_heads,
                              local=_local(o_loc, lse_loc))
    return twin.forward(_unfolded(q, k, q_heads), k, v, block_indices, cu_seqlens, scale, sel_block)


def _gated_impl(q: Tensor, k: Tensor, v: Tensor, block_indices: Tensor, cu_seqlens: Optional[Tensor], scale: float,
                sel_block: int, impl: str, q_heads: int, cmp_rows: Tensor, cmp_head: int, o_win: Tensor,
                gates: Tensor, o_loc: Optional[Tensor], lse_loc: Optional[Tensor]) -> Tensor:
    if runs_triton(q, impl):
        return launch.forward_gated(q, k, v, block_indices, cu_seqlens, scale, sel_block, cmp_rows, cmp_head, o_win,
                                    gates, q_heads=q_heads, local=_local(o_loc, lse_loc))
    o_sel, _ = twin.forward(_unfolded(q, k, q_heads), k, v, block_indices, cu_seqlens, scale, sel_block)
    return gated_sum_twin.forward(cmp_rows, cmp_head, o_sel, o_win, gates)


def _backward_impl(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, block_indices: Tensor,
                   cu_seqlens: Optional[Tensor], scale: float, sel_block: int,
                   impl: str, q_heads: int) -> tuple[Tensor, Tensor, Tensor]:
    if runs_triton(q, impl):
        return launch.backward(do, q, k, v, o, lse, block_indices, cu_seqlens, scale, sel_block, q_heads=q_heads)
    dq, dk, dv = twin.backward(do, _unfolded(q, k, q_heads), k, v, o, lse, block_indices, cu_seqlens, scale,
                               sel_block)
    return (fold(dq, k.shape[2], rows=q.shape[2]) if q_heads else dq), dk, dv


def _local(o_loc: Optional[Tensor], lse_loc: Optional[Tensor]) -> Optional[tuple[Tensor, Tensor]]:
    return None if o_loc is None else dense(o_loc, lse_loc)


def _unfolded(q: Tensor, k: Tensor, q_heads: int) -> Tensor:
    """q as [B, T, Hq, Dk] (a copy when folded)."""
    if not q_heads:
        return q
    T = k.shape[1]
    return unfold(q[:, :, :T * (q_heads // k.shape[2])], T)


with quiet_without_triton():
    _forward_op = triton_op("nsa_flex::selected_attention", mutates_args=())(_forward_impl)
    _backward_op = triton_op("nsa_flex::selected_attention_backward", mutates_args=())(_backward_impl)
    _gated_op = triton_op("nsa_flex::selected_gated_sum", mutates_args=())(_gated_impl)


@_forward_op.register_fake
def _forward_fake(q, k, v, block_indices, cu_seqlens, scale, sel_block, impl, q_heads, o_loc, lse_loc):
    B, T = k.shape[:2]
    Hq = launch.query_heads(q, q_heads)
    return q.new_empty(B, T, Hq, v.shape[-1]), q.new_empty(B, Hq, T, dtype=torch.float32)


@_gated_op.register_fake
def _gated_fake(q, k, v, block_indices, cu_seqlens, scale, sel_block, impl, q_heads, cmp_rows, cmp_head, o_win,
                gates, o_loc, lse_loc):
    return q.new_empty(k.shape[0], k.shape[1], launch.query_heads(q, q_heads), v.shape[-1])


@_backward_op.register_fake
def _backward_fake(do, q, k, v, o, lse, block_indices, cu_seqlens, scale, sel_block, impl, q_heads):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, block_indices, cu_seqlens, scale, sel_block, impl, q_heads, _, _ = inputs
    o, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, o, lse, block_indices, cu_seqlens)
    ctx.args = (scale, sel_block, impl, q_heads)


def _backward(ctx, do, _dlse):
    q, k, v, o, lse, block_indices, cu_seqlens = ctx.saved_tensors
    dq, dk, dv = torch.ops.nsa_flex.selected_attention_backward(do, q, k, v, o, lse, block_indices, cu_seqlens,
                                                                *ctx.args)
    return dq, dk, dv, None, None, None, None, None, None, None, None


_forward_op.register_autograd(_backward, setup_context=_setup_context)


def _check_local(local, k: Tensor, v: Tensor, Hq: int) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """(o_loc, lse_loc) of `local`, or (None, None); the shapes ops.window.window_and_local gives
    (one sequence per batch row: the callers that take a partial have no cu_seqlens)."""
    if local is None:
        return None, None
    o_loc, lse_loc = local
    B, T, Hkv = k.shape[:3]
    rows = T * (Hq // Hkv)
    if o_loc.shape != (B, Hkv, rows, v.shape[-1]) or lse_loc.shape != (B, Hkv, rows) \
            or lse_loc.dtype != torch.float32 or o_loc.device != k.device or lse_loc.device != k.device:
        raise ValueError(f"local: o_loc {tuple(o_loc.shape)} and lse_loc {tuple(lse_loc.shape)} {lse_loc.dtype} must "
                         f"be [{B}, {Hkv}, {rows}, {v.shape[-1]}] and float32 [{B}, {Hkv}, {rows}] on {k.device}, as "
                         "ops.window.window_and_local gives them")
    return o_loc, lse_loc


def _check_inputs(q, k, v, block_indices, cu_seqlens, impl, q_heads: int = 0) -> None:
    """Shape, dtype and device checks; every error says what was wrong and what is allowed."""
    if impl not in _IMPLS:
        raise ValueError(f"impl={impl!r}; allowed: {', '.join(_IMPLS)}")
    q_dims = "[B, Hkv, R >= T*G, Dk] (folded)" if q_heads else "[B, T, Hq, Dk]"
    check_4d({"q": (q, q_dims), "k": (k, "[B, T, Hkv, Dk]"), "v": (v, "[B, T, Hkv, Dv]"),
              "block_indices": (block_indices, "[B, Hkv, T, n]")}, "q")
    Hkv = k.shape[2]
    if q_heads:
        B, T = k.shape[:2]
        Dk = q.shape[3]
        if Hkv == 0 or q_heads % Hkv != 0:
            raise ValueError(f"config's {q_heads} query heads must be a multiple of k's {Hkv} kv heads")
        if q.shape[:2] != (B, Hkv) or q.shape[2] < T * (q_heads // Hkv):
            raise ValueError(f"folded q {tuple(q.shape)} does not fit k {tuple(k.shape)} and {q_heads} query heads: "
                             f"expected [{B}, {Hkv}, >= {T * (q_heads // Hkv)}, Dk]")
    else:
        B, T, Hq, Dk = q.shape
        if Hkv == 0 or Hq % Hkv != 0:
            raise ValueError(f"q's {Hq} heads must be a multiple of k's {Hkv} kv heads")
    if k.shape[:2] != (B, T) or k.shape[3] != Dk or v.shape[:3] != k.shape[:3]:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} do not fit q {tuple(q.shape)}: "
                         f"expected k [{B}, {T}, Hkv, {Dk}] and v [{B}, {T}, Hkv, Dv]")
    if block_indices.shape[:3] != (B, Hkv, T) or block_indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"block_indices must be int32/int64 [B, Hkv, T, n] = [{B}, {Hkv}, {T}, n], got "
                         f"{tuple(block_indices.shape)} {block_indices.dtype}")
    allowed = _KERNEL_DTYPES if runs_triton(q, impl) else _KERNEL_DTYPES + (torch.float64,)
    if q.dtype not in allowed or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v have dtypes {q.dtype}, {k.dtype}, {v.dtype}; they must match, one of "
                        f"{', '.join(map(str, allowed))}")
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"packed documents (cu_seqlens) need batch size 1, got B={B}")
        if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2 or cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"cu_seqlens must be a 1-D int32/int64 tensor [n_docs + 1], got shape "
                             f"{tuple(cu_seqlens.shape)} dtype {cu_seqlens.dtype}")
        if cu_seqlens.device != q.device:
            raise ValueError(f"cu_seqlens is on {cu_seqlens.device} but q is on {q.device}")
