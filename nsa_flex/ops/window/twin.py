"""The torch twin of nsa_flex::window_attention: the same attention with a dense mask per chunk
of queries (any device, fp32 math, fp64 stays fp64). The CPU path and the tests' second opinion."""

from __future__ import annotations

import math

import torch
from torch import Tensor

# Query tokens per chunk: a chunk's scores are [B, Hkv, chunk*G, chunk + W - 1].
_CHUNK = 256


def _chunks(q: Tensor, k: Tensor, group: int, window: int, scale: float, acc: torch.dtype, local_block: int = 0):
    """Per chunk of query tokens: (row slice, key slice, scores [B, Hkv, rows, keys] with -inf outside
    the window, and with local_block > 0 the mask of each row's two local selection blocks, else None)."""
    T = k.shape[1]
    for t0 in range(0, T, _CHUNK):
        t1 = min(T, t0 + _CHUNK)
        s0 = max(0, t0 - window + 1)
        rows, keys = slice(t0 * group, t1 * group), slice(s0, t1)
        scores = q[:, :, rows].to(acc) @ k[:, keys].transpose(1, 2).to(acc).transpose(-1, -2) * scale
        tok = torch.arange(t0 * group, t1 * group, device=q.device) // group
        key = torch.arange(s0, t1, device=q.device)
        seen = (key[None, :] <= tok[:, None]) & (key[None, :] > tok[:, None] - window)
        local = None
        if local_block:
            local = (key[None, :] <= tok[:, None]) & (key[None, :] >= (tok[:, None] // local_block - 1) * local_block)
        yield rows, keys, scores.masked_fill(~seen, float("-inf")), local


def local_buffers(q: Tensor, k: Tensor, v: Tensor, group: int, local_block: int) -> tuple[Tensor, Tensor]:
    """(o_loc, lse_loc) as the op returns them: o's shape in q's dtype and lse's in fp32 with a
    local partial (local_block > 0), else empty; uninitialised (every row is written)."""
    B, T, Hkv, _ = k.shape
    R = T * group if local_block else 0
    return (q.new_empty(B, Hkv, R, v.shape[-1]) if local_block else q.new_empty(0),
            torch.empty((B, Hkv, R) if local_block else (0,), dtype=torch.float32, device=q.device))


def forward(q: Tensor, k: Tensor, v: Tensor, group: int, window: int, scale: float,
            local_block: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(o [B, Hkv, T*G, Dv] in q's dtype, lse [B, Hkv, T*G] fp32 base 2, o_loc, lse_loc: the same
    over each row's two local selection blocks when local_block > 0, else empty): as the op's."""
    B, T, Hkv, _ = k.shape
    acc = torch.promote_types(q.dtype, torch.float32)
    o = q.new_zeros(B, Hkv, T * group, v.shape[-1])
    lse = torch.zeros(B, Hkv, T * group, dtype=torch.float32, device=q.device)
    o_loc, lse_loc = local_buffers(q, k, v, group, local_block)
    for rows, keys, scores, local in _chunks(q, k, group, window, scale, acc, local_block):
        v_c = v[:, keys].transpose(1, 2).to(acc)
        for out, out_lse, s in ((o, lse, scores), (o_loc, lse_loc, None if local is None else
                                                    scores.masked_fill(~local, float("-inf")))):
            if s is None:
                continue
            chunk_lse = s.logsumexp(-1)
            out[:, :, rows] = ((s - chunk_lse[..., None]).exp() @ v_c).to(q.dtype)
            out_lse[:, :, rows] = (chunk_lse / math.log(2)).float()
    return o, lse, o_loc, lse_loc


def backward(do: Tensor, q: Tensor, k: Tensor, v: Tensor, group: int, window: int,
             scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) in q's, k's and v's shapes and dtypes (dq's rows past T*G zero), written out:
    an op's body runs below autograd, so no autograd here."""
    acc = torch.promote_types(q.dtype, torch.float32)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk, dv = (torch.zeros(x.shape, dtype=acc, device=q.device) for x in (k, v))
    for rows, keys, scores, _ in _chunks(q, k, group, window, scale, acc):
        p = (scores - scores.logsumexp(-1, keepdim=True)).exp()
        k_c, v_c = (x[:, keys].transpose(1, 2).to(acc) for x in (k, v))
        do_c = do[:, :, rows].to(acc)
        dp = do_c @ v_c.transpose(-1, -2)
        ds = p * (dp - (dp * p).sum(-1, keepdim=True))
        dq[:, :, rows] = scale * ds @ k_c
        dk[:, keys] += (scale * ds.transpose(-1, -2) @ q[:, :, rows].to(acc)).transpose(1, 2)
        dv[:, keys] += (p.transpose(-1, -2) @ do_c).transpose(1, 2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
