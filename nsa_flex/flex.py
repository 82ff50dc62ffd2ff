"""NSA through FlexAttention: nsa_attention(..., impl="flex").

compressed Flex call (with lse) -> selection op -> selected Flex call (folded GQA layout)
-> window Flex call -> gated sum. Every step is traceable, so the whole op compiles with
`torch.compile(nsa_flex, fullgraph=True)` and the gated sum fuses with the layout changes.

On CUDA the flex calls go through one small function per branch, compiled once at module
level (inside an outer compile Dynamo inlines them). On CPU flex runs eagerly (dense, for correctness, no
backward: FlexAttention has none on CPU) and the compressed branch's lse, which compiled
CPU flex cannot return, comes from a small dense torch computation.

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


# One small function per branch, each compiled once here: separate code objects keep Dynamo's
# per-function recompile limit (8 shapes) per branch instead of shared by all three.
def _flex_gqa_lse(q, k, v, block_mask, scale, kernel_options):
    return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True,
                          return_aux=AuxRequest(lse=True), kernel_options=kernel_options)


def _flex_folded(q, k, v, block_mask, scale, kernel_options):
    return flex_attention(q, k, v, block_mask=block_mask, scale=scale, kernel_options=kernel_options)


def _flex_gqa(q, k, v, block_mask, scale, kernel_options):
    return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True,
                          kernel_options=kernel_options)


_COMPILED = {fn: torch.compile(fn, dynamic=False) for fn in (_flex_gqa_lse, _flex_folded, _flex_gqa)}


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
    T, Tc = q.shape[1], k_cmp.shape[1]
    scale = q.shape[-1] ** -0.5
    docs = cu_cmp = None
    if cu_seqlens is not None:
        cu_cmp = compressed_seqlens(cu_seqlens, config)
        docs = documents(cu_seqlens, cu_cmp, T, Tc)
    o_cmp, lse_cmp = compressed_branch(q, k_cmp, v_cmp, config, scale, tiles, docs)
    if block_indices is None:
        block_indices = select_blocks(q, k_cmp, lse_cmp, config, scale=scale, cu_seqlens=cu_seqlens,
                                      cu_seqlens_cmp=cu_cmp)
    o_sel = selected_branch(q, k, v, block_indices, config, scale, tiles, docs)
    k_win, v_win = (k if k_win is None else k_win), (v if v_win is None else v_win)
    o_win = window_branch(q, k_win, v_win, config, scale, tiles, docs)
    # Sum in at least fp32 (fp64 stays fp64); torch.compile fuses it with the layout changes.
    acc = torch.promote_types(q.dtype, torch.float32)
    g = gates.to(acc)
    o = g[..., 0:1] * o_cmp.to(acc) + g[..., 1:2] * o_sel.to(acc) + g[..., 2:3] * o_win.to(acc)
    return o.to(q.dtype), block_indices


def compressed_branch(q, k_cmp, v_cmp, config: NSAConfig, scale: float, tiles: FlexTiles,
                      docs: Documents | None = None):
    """(o [B,T,Hq,Dv], lse [B,Hq,T] float32, natural log, -inf where no block is complete)."""
    B, T, Hq, _ = q.shape
    Tc, Dv = k_cmp.shape[1], v_cmp.shape[-1]
    if Tc == 0:
        # No complete compression block anywhere (T < l): the branch is exactly 0.
        return q.new_zeros(B, T, Hq, Dv), q.new_full((B, Hq, T), float("-inf"), dtype=torch.float32)
    q_bhtd, k_bhtd, v_bhtd = q.transpose(1, 2), k_cmp.transpose(1, 2), v_cmp.transpose(1, 2)
    mask = compressed_block_mask(T, Tc, config, q.device, tiles.cmp_block, docs)
    if q.is_cuda:
        o, aux = _call(_flex_gqa_lse, q_bhtd, k_bhtd, v_bhtd, mask, scale, "cmp")
        lse = aux.lse
    else:
        # Compiled CPU flex cannot return the lse: take it from the dense scores there.
        o = _call(_flex_gqa, q_bhtd, k_bhtd, v_bhtd, mask, scale, "cmp")
        lse = _dense_lse(q_bhtd, k_bhtd, mask, scale)
    return o.transpose(1, 2), lse.float()


def selected_branch(q, k, v, block_indices, config: NSAConfig, scale: float, tiles: FlexTiles,
                    docs: Documents | None = None):
    """o [B,T,Hq,Dv] of the selected blocks, computed in the folded layout [B, Hkv, T*G, D]."""
    B, T, Hq, Dk = q.shape
    Hkv, Dv = k.shape[2], v.shape[-1]
    G = Hq // Hkv
    # Row t*G + g of kv head h is query head h*G + g at token t.
    q_fold = q.view(B, T, Hkv, G, Dk).transpose(1, 2).reshape(B, Hkv, T * G, Dk)
    mask = selection_block_mask(block_indices, T, G, config, tiles.sel_q_block, docs)
    o = _call(_flex_folded, q_fold, k.transpose(1, 2), v.transpose(1, 2), mask, scale, "sel")
    return o.view(B, Hkv, T, G, Dv).transpose(1, 2).reshape(B, T, Hq, Dv)


def window_branch(q, k, v, config: NSAConfig, scale: float, tiles: FlexTiles, docs: Documents | None = None):
    """o [B,T,Hq,Dv] of the sliding window (w tokens, the query included)."""
    T = q.shape[1]
    mask = window_block_mask(T, config.window, q.device, tiles.win_block, docs)
    o = _call(_flex_gqa, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, scale, "win")
    return o.transpose(1, 2)


def _dense_lse(q_bhtd, k_bhtd, mask, scale: float) -> torch.Tensor:
    """CPU only: lse [B,Hq,T] from the dense scores under the mask's mask_mod (small T only)."""
    G = q_bhtd.shape[1] // k_bhtd.shape[1]
    dtype = torch.promote_types(q_bhtd.dtype, torch.float32)
    scores = (q_bhtd.to(dtype) @ k_bhtd.to(dtype).repeat_interleave(G, 1).transpose(-1, -2)) * scale
    visible = create_mask(mask.mask_mod, None, None, q_bhtd.shape[2], k_bhtd.shape[2], q_bhtd.device)
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
