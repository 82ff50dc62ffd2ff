"""Host side of the Triton path: tiles, buffers and the launches of kernels.py.

Runs on CUDA tensors, or on CPU tensors under Triton's interpreter (tests). No host syncs:
every grid and buffer size is a function of the shapes.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from nsa_flex.ops.selected_attention import kernels
from nsa_flex.ops.selected_attention.index import SelectionIndex, build_index, work_list
from nsa_flex.ops.triton_utils import next_pow2

if kernels.HAS_TRITON:
    from torch.library import wrap_triton

TILE_KEYS = ("BT", "fwd_chunks", "bwd_chunks", "fwd_warps", "bwd_warps", "num_stages")


def launch_config(G: int, Dk: int, Dv: int, dtype: torch.dtype) -> dict[str, int]:
    """Tiles and launch settings for group G, head dims Dk / Dv and the input dtype.

    BT tokens per chunk give M = BT * G' query rows per tl.dot (G' = G rounded up to a power
    of two): M = 64 for 16-bit inputs with padded head dims <= 128, else 32 (fp32, or Dk = 192
    padded to 256: the dots' operands in shared memory stay well under Hopper's 227 KB). M >= 32
    keeps tl.dot's 16-row minimum; G' > 32 takes one token per chunk.

    A forward item walks fwd_chunks chunks with one load of K/V (K/V bytes per token shrink by
    BT * fwd_chunks against the token-centric loop); its partial o per (token, slot) is written
    anyway, so a few chunks suffice. A backward item walks bwd_chunks chunks with dK/dV in
    registers and then writes one fp32 [l', Dk + Dv] partial: 32 chunks make that write ~3% of
    the item's traffic while block 0 (read by all T tokens) still splits into T / (32 BT) items.
    The backward holds two [l', D] accumulators: 8 warps once padded Dk + Dv >= 256.

    Compiled for sm_90 without a GPU (Triton 3.6, ptxas -v, bf16, l' = 64): forward 127-190
    registers, 49-99 KB shared memory, no spills; backward at Dk = Dv = 64 with 4 warps 240
    registers, 66 KB; at 128/128 with 8 warps 254-255 registers (G=16: no spill, G=4: 60 bytes),
    132 KB; at 192/128 (M = 32) 244 registers, 123 KB. fp32 (IEEE FMA dots, M = 32) spills but
    stays within shared memory (164 KB for the backward at 192/128). Not yet timed on a GPU.
    """
    GP = next_pow2(G)
    DKP, DVP = max(16, next_pow2(Dk)), max(16, next_pow2(Dv))
    rows = 32 if dtype == torch.float32 or max(DKP, DVP) > 128 else 64
    BT = max(1, rows // GP)
    return {"BT": BT, "fwd_chunks": 4, "bwd_chunks": 32, "fwd_warps": 4,
            "bwd_warps": 8 if DKP + DVP >= 256 else 4, "num_stages": 2}


def _tiles(q: Tensor, k: Tensor, v: Tensor, tiles: dict | None) -> dict:
    tiles = tiles or {}
    unknown = sorted(set(tiles) - set(TILE_KEYS))
    if unknown:
        raise ValueError(f"unknown selected_attention tile keys {unknown}; allowed: {', '.join(TILE_KEYS)}")
    G = q.shape[2] // k.shape[2]
    return {**launch_config(G, q.shape[-1], v.shape[-1], q.dtype), **tiles}


def _constexprs(q: Tensor, k: Tensor, v: Tensor, sel_block: int, n: int, BT: int) -> dict:
    G = q.shape[2] // k.shape[2]
    Dk, Dv = q.shape[-1], v.shape[-1]
    return dict(N=n, G=G, GP=next_pow2(G), BT=BT, BL=max(16, next_pow2(sel_block)), DK=Dk, DKP=max(16, next_pow2(Dk)),
                DV=Dv, DVP=max(16, next_pow2(Dv)), F32_DOT=q.device.type == "cpu", IEEE=q.dtype == torch.float32)


def forward(q, k, v, block_indices, cu_seqlens, scale: float, sel_block: int, tiles=None):
    """(o [B,T,Hq,Dv] in q's dtype, lse [B,Hq,T] fp32 natural log) on the Triton path."""
    q, k, v = _unit_stride(q, k, v)
    B, T, Hq, _ = q.shape
    Hkv, n, Dv = k.shape[2], block_indices.shape[-1], v.shape[-1]
    cfg = _tiles(q, k, v, tiles)
    index, items = index_and_items(block_indices, sel_block, cu_seqlens, cfg["BT"] * cfg["fwd_chunks"], T, n)
    po = torch.empty(B, T, Hq, n, Dv, dtype=torch.float32, device=q.device)
    plse = torch.empty(B, T, Hq, n, dtype=torch.float32, device=q.device)
    Nv = index.blk_start.shape[0]
    if items.blk.shape[0] > 0:
        wrap_triton(kernels._fwd_kernel)[(items.blk.shape[0],)](
            q, k, v, po, plse, index.entries, items.blk, items.start, items.end, index.blk_start, index.blk_end,
            Hkv, Nv, scale, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *po.stride()[:4],
            *plse.stride()[:3], **_constexprs(q, k, v, sel_block, n, cfg["BT"]),
            num_warps=cfg["fwd_warps"], num_stages=cfg["num_stages"])
    o = torch.empty(B, T, Hq, Dv, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, Hq, T, dtype=torch.float32, device=q.device)
    _slot_sum(po, plse, index, o, lse, merge=True)
    return o, lse


def backward(do, q, k, v, o, lse, block_indices, cu_seqlens, scale: float, sel_block: int, tiles=None):
    """(dq, dk, dv) in the inputs' dtypes on the Triton path; lse as forward returns it."""
    q, k, v = _unit_stride(q, k, v)
    B, T, Hq, Dk = q.shape
    Hkv, n = k.shape[2], block_indices.shape[-1]
    cfg = _tiles(q, k, v, tiles)
    consts = _constexprs(q, k, v, sel_block, n, cfg["BT"])
    index, items = index_and_items(block_indices, sel_block, cu_seqlens, cfg["BT"] * cfg["bwd_chunks"], T, n)
    W, Nv = items.blk.shape[0], index.blk_start.shape[0]
    do = do.contiguous()
    # [B, Hq, T] like lse: the kernel reads both at one offset.
    delta = (do.float() * o.float()).sum(-1).transpose(1, 2).contiguous()
    lse = lse.contiguous()
    dqp = torch.empty(B, T, Hq, n, Dk, dtype=torch.float32, device=q.device)
    dkp = torch.empty(W, consts["BL"], consts["DKP"], dtype=torch.float32, device=q.device)
    dvp = torch.empty(W, consts["BL"], consts["DVP"], dtype=torch.float32, device=q.device)
    if W > 0:
        wrap_triton(kernels._bwd_kernel)[(W,)](
            q, k, v, do, lse, delta, dqp, dkp, dvp, index.entries, items.blk, items.start, items.end,
            index.blk_start, index.blk_end, Hkv, Nv, scale, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
            *do.stride()[:3], *lse.stride(), *dqp.stride()[:4], **consts,
            num_warps=cfg["bwd_warps"], num_stages=cfg["num_stages"])
    dk, dv = k.new_empty(k.shape), v.new_empty(v.shape)
    if B * Hkv * Nv > 0:
        wrap_triton(kernels._block_sum_kernel)[(B * Hkv * Nv,)](
            dkp, dvp, dk, dv, items.first_item, items.n_items, index.blk_start, index.blk_end, Hkv, Nv,
            *dk.stride()[:3], *dv.stride()[:3], BL=consts["BL"], DK=Dk, DKP=consts["DKP"], DV=consts["DV"],
            DVP=consts["DVP"], num_warps=8 if consts["DKP"] + consts["DVP"] > 256 else 4)
    dq = q.new_empty(q.shape)
    _slot_sum(dqp, None, index, dq, None, merge=False)
    return dq, dk, dv


def _index_and_items(block_indices, sel_block: int, cu_seqlens, span: int, T: int, n: int):
    index = build_index(block_indices, sel_block, cu_seqlens)
    return index, work_list(index, span, T, n)


_COMPILED_INDEX = torch.compile(_index_and_items, dynamic=False)


def index_and_items(block_indices, sel_block: int, cu_seqlens, span: int, T: int, n: int):
    """(SelectionIndex, WorkList). Compiled once per shape on CUDA: eagerly its ~60 small kernels
    take more host time than the attention takes on the GPU at 8k tokens. Inside an outer
    torch.compile (or on CPU) the plain functions run, and the outer graph fuses them."""
    global _COMPILED_INDEX
    if _COMPILED_INDEX is not None and block_indices.is_cuda and not torch.compiler.is_compiling():
        try:
            return _COMPILED_INDEX(block_indices, sel_block, cu_seqlens, span, T, n)
        except Exception as exc:  # a compiler bug of this torch version: the same functions, eagerly
            _COMPILED_INDEX = None
            warnings.warn(f"selected_attention: compiling the selection index failed on torch {torch.__version__} "
                          f"({type(exc).__name__}); it runs eagerly from now on (same result, more host time)")
    return _index_and_items(block_indices, sel_block, cu_seqlens, span, T, n)


def _unit_stride(*xs: Tensor) -> tuple[Tensor, ...]:
    """The kernels index the head dim with unit stride; anything else is copied."""
    return tuple(x if x.stride(-1) == 1 else x.contiguous() for x in xs)


def _slot_sum(part, plse, index: SelectionIndex, out, lse, merge: bool) -> None:
    """out[b, t, hq] = the n slots' partials of (b, t, hq) merged (forward) or summed (dQ)."""
    B, T, Hq, n, D = part.shape
    if B * T * Hq == 0:
        return
    gid = index.gid_bhtn
    G = Hq // gid.shape[1]
    # Without merge the lse pointers are never read: pass the partial in their place.
    plse_ = plse if merge else part
    lse_ = lse if merge else part
    wrap_triton(kernels._slot_kernel)[(B * T * Hq,)](
        part, plse_, gid, out, lse_, T, Hq, G, *part.stride()[:4], *plse_.stride()[:3], *gid.stride()[:3],
        *out.stride()[:3], *lse_.stride()[:3], N=n, NP=next_pow2(n), D=D, DP=max(16, next_pow2(D)), MERGE=merge,
        num_warps=1 if D <= 64 else 2)
