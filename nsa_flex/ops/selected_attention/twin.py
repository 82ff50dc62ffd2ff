"""The torch twin of nsa_flex::selected_attention: the same function as dense masked softmax.

Any device, fp32 math (fp64 stays fp64), tokens in chunks so the [rows, T] scores stay below
_CHUNK_ELEMENTS per call: memory is bounded for any T (time is O(T^2); it is the CPU path and
the tests' second opinion, not a fast path). Forward and backward are explicit formulas (the
backward recomputes P from the saved lse) so the op's autograd needs no autograd inside.
"""

from __future__ import annotations

import torch
from torch import Tensor

from nsa_flex.blocks import document_of
from nsa_flex.ops.selected_attention.index import _bounds

# Score elements (B * Hq * rows * T) held at once.
_CHUNK_ELEMENTS = 1 << 22


def forward(q, k, v, block_indices, cu_seqlens, scale: float, sel_block: int) -> tuple[Tensor, Tensor]:
    """(o [B,T,Hq,Dv] in q's dtype, lse [B,Hq,T] fp32 natural log, -inf where no key is visible)."""
    B, T, Hq, _ = q.shape
    Hkv, Dv = k.shape[2], v.shape[-1]
    G = Hq // Hkv
    acc = torch.promote_types(q.dtype, torch.float32)
    k_bhdt, v_bhtd = _keys(k, acc), _keys(v, acc).transpose(-1, -2)
    o = q.new_empty(B, T, Hq, Dv)
    lse = torch.empty(B, Hq, T, dtype=torch.float32, device=q.device)
    for t0, t1, vis in _chunks(block_indices, cu_seqlens, sel_block, B * Hq * T):
        s = _scores(q, k_bhdt, t0, t1, G, acc, scale)
        s = s.masked_fill(~vis, float("-inf"))
        lse_c = torch.logsumexp(s, dim=-1)  # -inf for rows without a visible key
        p = torch.exp(s - torch.where(torch.isfinite(lse_c), lse_c, 0.0)[..., None])
        o_c = p @ v_bhtd[:, :, None]  # [B, Hkv, G, rows, Dv]
        o[:, t0:t1] = o_c.permute(0, 3, 1, 2, 4).reshape(B, t1 - t0, Hq, Dv).to(q.dtype)
        lse[:, :, t0:t1] = lse_c.reshape(B, Hq, t1 - t0).float()
    return o, lse


def backward(do, q, k, v, o, lse, block_indices, cu_seqlens, scale: float, sel_block: int):
    """(dq, dk, dv) in the inputs' dtypes: flash-attention's backward on dense masked scores."""
    B, T, Hq, Dk = q.shape
    Hkv, Dv = k.shape[2], v.shape[-1]
    G = Hq // Hkv
    acc = torch.promote_types(q.dtype, torch.float32)
    k_bhdt, v_bhdt = _keys(k, acc), _keys(v, acc)
    dk = torch.zeros(B, Hkv, T, Dk, dtype=acc, device=q.device)
    dv = torch.zeros(B, Hkv, T, Dv, dtype=acc, device=q.device)
    dq = q.new_empty(B, T, Hq, Dk)
    lse_bhgt = lse.to(acc).view(B, Hkv, G, T)
    for t0, t1, vis in _chunks(block_indices, cu_seqlens, sel_block, B * Hq * T):
        rows = t1 - t0
        s = _scores(q, k_bhdt, t0, t1, G, acc, scale)
        lse_c = lse_bhgt[..., t0:t1, None]
        p = torch.where(vis, torch.exp(s - torch.where(torch.isfinite(lse_c), lse_c, 0.0)), 0.0)
        do_c = _rows(do, t0, t1, Hkv, acc)  # [B, Hkv, G, rows, Dv]
        delta = (do_c * _rows(o, t0, t1, Hkv, acc)).sum(-1, keepdim=True)
        dv += (p.transpose(-1, -2) @ do_c).sum(2)
        ds = p * (do_c @ v_bhdt[:, :, None] - delta)
        dk += scale * (ds.transpose(-1, -2) @ _rows(q, t0, t1, Hkv, acc)).sum(2)
        dq_c = scale * (ds @ k_bhdt[:, :, None].transpose(-1, -2))
        dq[:, t0:t1] = dq_c.permute(0, 3, 1, 2, 4).reshape(B, rows, Hq, Dk).to(q.dtype)
    return dq, dk.transpose(1, 2).to(k.dtype).contiguous(), dv.transpose(1, 2).to(v.dtype).contiguous()


def _keys(x_bthd: Tensor, acc) -> Tensor:
    """[B, T, Hkv, D] -> [B, Hkv, D, T] in the accumulation dtype."""
    return x_bthd.to(acc).permute(0, 2, 3, 1)


def _rows(x_bthd: Tensor, t0: int, t1: int, Hkv: int, acc) -> Tensor:
    """Tokens [t0, t1) of [B, T, Hq, D] -> [B, Hkv, G, rows, D]."""
    B, _, Hq, D = x_bthd.shape
    return x_bthd[:, t0:t1].to(acc).reshape(B, t1 - t0, Hkv, Hq // Hkv, D).permute(0, 2, 3, 1, 4)


def _scores(q, k_bhdt, t0: int, t1: int, G: int, acc, scale: float) -> Tensor:
    """scale * q . k of tokens [t0, t1) against every key: [B, Hkv, G, rows, T]."""
    return (_rows(q, t0, t1, k_bhdt.shape[1], acc) @ k_bhdt[:, :, None]) * scale


def _chunks(block_indices, cu_seqlens, sel_block: int, per_row: int):
    """(t0, t1, visible [B, Hkv, 1, rows, T]) over token chunks: key s is visible to query t iff
    both lie in one document, s <= t and s's document-local block is among t's selected ones."""
    B, Hkv, T, n = block_indices.shape
    device = block_indices.device
    cu = _bounds(cu_seqlens, T, device)
    s = torch.arange(T, device=device)
    doc = document_of(cu, s)
    key_blk = (s - cu[doc]) // sel_block
    Ns = -(-T // sel_block)
    rows = max(1, _CHUNK_ELEMENTS // max(1, per_row))
    for t0 in range(0, T, rows):
        t1 = min(T, t0 + rows)
        j = block_indices[:, :, t0:t1].long()
        # Unused slots and ids past any block scatter into a spare column Ns, dropped after.
        j = torch.where((j >= 0) & (j < Ns), j, Ns)
        chosen = torch.zeros(B, Hkv, t1 - t0, Ns + 1, dtype=torch.bool, device=device)
        chosen.scatter_(-1, j, True)
        t = s[t0:t1, None]
        vis = chosen[..., key_blk] & (s[None, :] <= t) & (doc[None, :] == doc[t0:t1, None])
        yield t0, t1, vis[:, :, None]
