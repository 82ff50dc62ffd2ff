"""NSA through FlexAttention: nsa_attention(..., impl="flex").

compressed Flex call (with lse) -> selection op -> selected Flex call -> window Flex call
-> gated sum. All three calls use the folded GQA layout, q [B, T, Hq, D] ->
[B, Hkv, T*G, D] (row t*G + g = query head h*G + g at token t), so none goes through
FlexAttention's enable_gqa path: on torch 2.11 that path gave wrong dK/dV for the window
branch in several configurations, while the folded selected branch was right in all
(bench/results/flex_gpu_tests.txt). Every step is traceable, so the whole op compiles
with `torch.compile(nsa_flex, fullgraph=True)` and the gated sum fuses with the unfolding.

On CUDA each branch's flex call is a small function compiled once at module level
(inside an outer compile Dynamo inlines it). On CPU flex runs eagerly (dense, for
correctness, no backward: FlexAttention has none there) and the compressed branch's lse,
which compiled CPU flex cannot return, comes from a small dense torch computation.

Process-global: the first eager CUDA call installs `nsa_flex.tuning.install_flex_tuning()`;
call it yourself before compiling code that uses nsa_flex.
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import AuxRequest, create_mask, flex_attention

from nsa_flex import tuning
from nsa_flex.compression import compressed_seqlens
from nsa_flex.config import NSAConfig
from nsa_flex.masks import compressed_block_mask, selection_block_mask, window_block_mask
from nsa_flex.masks.documents import Documents, documents
from nsa_flex.ops import select_blocks
from nsa_flex.tuning import FlexTiles


# One function per branch, each compiled once here: separate code objects give each branch
# its own Dynamo recompile budget (8 shapes) instead of one shared by all three.
def _flex_cmp(q, k, v, block_mask, scale, kernel_options):
    return flex_attention(q, k, v, block_mask=block_mask, scale=scale, return_aux=AuxRequest(lse=True),
                          kernel_options=kernel_options)


def _flex_sel(q, k, v, block_mask, scale, kernel_options):
    return flex_attention(q, k, v, block_mask=block_mask, scale=scale, kernel_options=kernel_options)


def _flex_win(q, k, v, block_mask, scale, kernel_options):
    return flex_attention(q, k, v, block_mask=block_mask, scale=scale, kernel_options=kernel_options)


_COMPILED = {fn: torch.compile(fn, dynamic=False) for fn in (_flex_cmp, _flex_sel, _flex_win)}


def _call(fn, q, k, v, block_mask, scale, branch: str):
    """A branch's flex call: compiled with its tiles on CUDA, eager (dense, exact) on CPU."""
    if q.is_cuda:
        opts = tuning.branch_kernel_options(branch, q.shape[-1], q.dtype, q_block=block_mask.BLOCK_SIZE[0],
                                            kv_block=block_mask.BLOCK_SIZE[1])
        return _COMPILED[fn](q, k, v, block_mask, scale, opts)
    return fn(q, k, v, block_mask, scale, None)


def nsa_flex(q, k, v, k_cmp, v_cmp, gates, config: NSAConfig, *, block_indices=None, cu_seqlens=None,
             k_win=None, v_win=None, tiles: FlexTiles = FlexTiles()):
    """NSA with FlexAttention. Shapes as nsa_attention: q [B,T,Hq,Dk], k [B,T,Hkv,Dk], v [B,T,Hkv,Dv],
    k_cmp/v_cmp [B,Tc,Hkv,*], gates [B,T,Hq,3] (cmp, sel, win).

    Returns (o [B,T,Hq,Dv], block_indices [B,Hkv,T,n]): the selection used, from the
    selection op unless given. cu_seqlens [n_docs+1] (B == 1): packed documents, every
    branch and the selection stay inside a document, block ids are document-local.
    tiles: BlockMask block sizes (speed knobs, see FlexTiles).
    """
    _check_device(q, k, v, k_cmp, v_cmp, gates, k_win, v_win)
    T, Tc, Hkv = q.shape[1], k_cmp.shape[1], k.shape[2]
    scale = q.shape[-1] ** -0.5
    docs = cu_cmp = None
    if cu_seqlens is not None:
        cu_cmp = compressed_seqlens(cu_seqlens, config)
        docs = documents(cu_seqlens, cu_cmp, T, Tc)
    q_fold = fold(q, Hkv)
    o_cmp, lse_cmp = compressed_branch(q_fold, k_cmp, v_cmp, config, scale, tiles, docs)
    if block_indices is None:
        block_indices = select_blocks(q, k_cmp, lse_cmp, config, scale=scale, cu_seqlens=cu_seqlens,
                                      cu_seqlens_cmp=cu_cmp)
    o_sel = selected_branch(q_fold, k, v, block_indices, config, scale, tiles, docs)
    k_win, v_win = (k if k_win is None else k_win), (v if v_win is None else v_win)
    o_win = window_branch(q_fold, k_win, v_win, config, scale, tiles, docs)
    # Sum in at least fp32 (fp64 stays fp64); torch.compile fuses it with the unfolding.
    acc = torch.promote_types(q.dtype, torch.float32)
    g = gates.to(acc)
    o = g[..., 0:1] * unfold(o_cmp, T).to(acc) + g[..., 1:2] * unfold(o_sel, T).to(acc) \
        + g[..., 2:3] * unfold(o_win, T).to(acc)
    return o.to(q.dtype), block_indices


def fold(x_bthd: torch.Tensor, Hkv: int) -> torch.Tensor:
    """[B, T, Hq, D] -> [B, Hkv, T*G, D]: row t*G + g of kv head h is query head h*G + g at token t."""
    B, T, Hq, D = x_bthd.shape
    return x_bthd.view(B, T, Hkv, Hq // Hkv, D).transpose(1, 2).reshape(B, Hkv, T * (Hq // Hkv), D)


def unfold(x_bhrd: torch.Tensor, T: int) -> torch.Tensor:
    """[B, Hkv, T*G, D] -> [B, T, Hq, D] (a view when possible; compiled, it fuses into the consumer)."""
    B, Hkv, rows, D = x_bhrd.shape
    G = rows // T
    return x_bhrd.view(B, Hkv, T, G, D).transpose(1, 2).reshape(B, T, Hkv * G, D)


def compressed_branch(q_fold, k_cmp, v_cmp, config: NSAConfig, scale: float, tiles: FlexTiles,
                      docs: Documents | None = None):
    """(o [B,Hkv,T*G,Dv], lse [B,Hq,T] float32, natural log, -inf where no block is complete)."""
    B, Hkv, rows, _ = q_fold.shape
    Tc, Dv = k_cmp.shape[1], v_cmp.shape[-1]
    G = config.group_size
    T = rows // G
    if Tc == 0:
        # No complete compression block anywhere (T < l): the branch is exactly 0.
        return (q_fold.new_zeros(B, Hkv, rows, Dv),
                q_fold.new_full((B, Hkv * G, T), float("-inf"), dtype=torch.float32))
    k_bhtd, v_bhtd = k_cmp.transpose(1, 2), v_cmp.transpose(1, 2)
    mask = compressed_block_mask(T, Tc, config, q_fold.device, tiles.cmp_block, G, docs)
    if q_fold.is_cuda:
        o, aux = _call(_flex_cmp, q_fold, k_bhtd, v_bhtd, mask, scale, "cmp")
        lse = aux.lse
    else:
        # Compiled CPU flex cannot return the lse: a call without it, the lse from dense scores.
        o = _call(_flex_sel, q_fold, k_bhtd, v_bhtd, mask, scale, "cmp")
        lse = _dense_lse(q_fold, k_bhtd, mask, scale)
    # [B, Hkv, T*G] -> [B, Hq, T]
    lse = lse.float().view(B, Hkv, T, G).transpose(2, 3).reshape(B, Hkv * G, T)
    return o, lse


def selected_branch(q_fold, k, v, block_indices, config: NSAConfig, scale: float, tiles: FlexTiles,
                    docs: Documents | None = None):
    """o [B,Hkv,T*G,Dv] of the selected blocks."""
    T = k.shape[1]
    mask = selection_block_mask(block_indices, T, q_fold.shape[2] // T, config, tiles.sel_q_block, docs)
    return _call(_flex_sel, q_fold, k.transpose(1, 2), v.transpose(1, 2), mask, scale, "sel")


def window_branch(q_fold, k, v, config: NSAConfig, scale: float, tiles: FlexTiles, docs: Documents | None = None):
    """o [B,Hkv,T*G,Dv] of the sliding window (w tokens, the query included)."""
    T = k.shape[1]
    mask = window_block_mask(T, config.window, q_fold.device, tiles.win_block, q_fold.shape[2] // T, docs)
    return _call(_flex_win, q_fold, k.transpose(1, 2), v.transpose(1, 2), mask, scale, "win")


def _dense_lse(q_bhrd, k_bhtd, mask, scale: float) -> torch.Tensor:
    """CPU only: lse [B, Hkv, rows] from the dense scores under the mask's mask_mod (small T only)."""
    dtype = torch.promote_types(q_bhrd.dtype, torch.float32)
    scores = (q_bhrd.to(dtype) @ k_bhtd.to(dtype).transpose(-1, -2)) * scale
    visible = create_mask(mask.mask_mod, None, None, q_bhrd.shape[2], k_bhtd.shape[2], q_bhrd.device)
    return scores.masked_fill(~visible, float("-inf")).logsumexp(-1)


def _check_device(*tensors) -> None:
    x = tensors[0]
    if x.is_cuda:
        if not torch.compiler.is_compiling():
            tuning.install_flex_tuning()
        elif not tuning.is_installed():
            raise RuntimeError("nsa_flex on CUDA under torch.compile: call nsa_flex.tuning.install_flex_tuning() "
                               "once before compiling (the selected branch's backward needs it)")
        return
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        raise RuntimeError(
            "impl='flex' has no backward on CPU (FlexAttention has none there); call it under "
            "torch.no_grad(), or use impl='reference' for CPU gradients"
        )
