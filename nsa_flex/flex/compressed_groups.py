"""The compressed branch as one plain causal attention call over token groups (cuDNN on CUDA).

Compression block i is visible to token t once complete: i*d + l - 1 <= t. So the tokens
t = l - 1 + I*d + j (0 <= j < d) of group I all see blocks 0..I, and Tc groups cover every token
from l - 1 on. With the d tokens x G query heads of a group as d*G heads over one kv head, the
branch is causal attention of Tc query positions over the Tc compressed keys, GQA ratio d*G: a
shape dense attention kernels run at their full rate, with no mask function and no partial
blocks. The folded rows t*G + g of one kv head are exactly that layout once the first (l-1)*G
rows are set aside, so the query side is a view of a padded copy; batch and kv head become the
batch of the call.

On CUDA the call is cuDNN's fused attention (aten._scaled_dot_product_cudnn_attention: output
and natural-log lse, autograd through cuDNN's backward); `causal_attention_lse` is the same
call in plain torch, for other devices and the tests. `compressed_grouped_detached` makes the call
without a gradient of its own, for the gated node that runs its backward (`grouped_backward`).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from nsa_flex.config import NSAConfig
from nsa_flex.folded import FoldedRows

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]]
"""(q [N, H, L, Dk], k [N, 1, L, Dk], v [N, 1, L, Dv], scale) -> (o [N, H, L, Dv], lse [N, H, L] natural log),
causal (query position I sees keys 0..I)."""

CUDNN_DTYPES = (torch.bfloat16, torch.float16)
CUDNN_HEAD_DIMS = (64, 128)


# Read once at import: torch.compile cannot trace the query (it returns a bool, not a tensor).
_HAS_CUDNN = torch.backends.cudnn.is_available()


def cudnn_applies(q: torch.Tensor, k_cmp: torch.Tensor, v_cmp: torch.Tensor) -> bool:
    """Whether cuDNN runs the grouped call for these inputs: CUDA, 16-bit, Dk = Dv in CUDNN_HEAD_DIMS.

    Those are the shapes the GPU tests check; others (fp32, Dk = 192 / Dv = 128) keep the Flex call.
    """
    return (_HAS_CUDNN and q.is_cuda and q.dtype in CUDNN_DTYPES
            and q.shape[-1] == k_cmp.shape[-1] == v_cmp.shape[-1] and q.shape[-1] in CUDNN_HEAD_DIMS)


def cudnn_attention_lse(q, k, v, scale: float):
    """Attend by cuDNN (CUDA, 16-bit): causal, kv heads shared GQA-style, lse in natural log.

    One compressed token (Tc = 1, T < l + d) runs causal_attention_lse: cuDNN rejects
    s_q = s_kv = 1. The backward runs in slices (_CudnnCausal, cudnn_backward).
    """
    if q.shape[2] == 1:
        return causal_attention_lse(q, k, v, scale)
    o, lse = _CudnnCausal.apply(q, k, v, scale)
    return o, lse.reshape(q.shape[:3])


CUDNN_BACKWARD_BYTES = 256 << 20
"""The most bytes of cuDNN's fp32 per-query-head dK / dV one backward call may hold (see
backward_slices). 256 MiB: g4 at 64k (d*G = 64 heads, 256 MiB a batch row) takes one row a call,
G=16 at 64k (1 GiB a row) four calls a row, seeds-125m's heads at 64k two rows a call
(docs/decisions.md, "The compressed branch as one cuDNN call")."""


def backward_slices(N: int, H: int, Hk: int, L: int, Dk: int, Dv: int) -> tuple[int, int]:
    """(batch rows, query heads) per cuDNN backward call (N rows of H query heads on Hk kv heads, L
    positions).

    With GQA (Hk < H) cuDNN's backward holds dK and dV of every query head in fp32 before it sums
    them per kv head: 4 L (Dk + Dv) bytes a query head. In the grouped call H is d*G (256 at G=16)
    on one kv head, and at 64k that buffer was the op's peak (4.0 GiB at G=16 in one call). So a
    call takes as many rows as keep it within CUDNN_BACKWARD_BYTES, at least one; where one row
    does not fit and its heads share one kv head (the grouped call), a call takes part of the
    row's heads, at least one. Each call more costs time (~0.1-0.2 ms at 64k), so what fits goes
    in one call.
    """
    if Hk >= H:
        return N, H
    fit = CUDNN_BACKWARD_BYTES // max(1, 4 * L * (Dk + Dv))
    if fit >= H or Hk > 1:
        return max(1, min(N, fit // H)), H
    return 1, max(1, fit)


def cudnn_forward(q, k, v, scale: float):
    """(o, lse, seed, offset): aten._scaled_dot_product_cudnn_attention's causal forward with lse
    (natural log, [N, H, L, 1]); seed and offset are what its backward takes back. Records no
    gradient of its own: callers give it inputs that need none (_CudnnCausal, or detached)."""
    o, lse, _, _, _, _, seed, offset, _ = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, True, False, scale=scale)
    return o, lse, seed, offset


Queries = Callable[[int, int], torch.Tensor]
"""(first, count) -> the call's queries of batch rows first .. first + count - 1 ([count, H, L, Dk])."""


def cudnn_backward(do, q, k, v, o, lse, seed, offset, scale: float, dq_parts: bool = False):
    """(dq, dk, dv) of cudnn_forward's call, in the calls backward_slices gives.

    q: the call's queries, or Queries giving each call's rows when it runs (the gated node's
    backward folds q's rows call by call, so that only one call's copy exists). A row split over
    calls of its heads (one kv head) gets its dK / dV as the sum of the calls' in fp32, one
    rounding more per call than one call would make (cuDNN returns each in q's dtype); its dQ heads
    are the calls' own. dq_parts: dq as [(first row, dq of the rows)], the calls' own tensors where
    they split by rows (no copy into one dq)."""
    N, H, L, Dv = do.shape
    Dk = k.shape[-1]
    rows, heads = backward_slices(N, H, k.shape[1], L, Dk, Dv)
    queries = q if callable(q) else lambda first, count: q[first:first + count]

    def call(r, qr, hs):
        return _backward_call(do[r, hs], qr[:, hs], k[r], v[r], o[r, hs], lse[r, hs], seed, offset, scale)

    every = slice(None)
    if rows >= N and heads >= H:
        dq, dk, dv = call(every, queries(0, N), every)
        return ([(0, dq)] if dq_parts else dq), dk, dv
    grads = []
    for i in range(0, N, rows):
        r = slice(i, i + rows)
        qr = queries(i, min(rows, N - i))
        if heads >= H:
            grads.append(call(r, qr, every))
        else:
            parts = [call(r, qr, slice(h, h + heads)) for h in range(0, H, heads)]
            dk, dv = (torch.stack([p[j] for p in parts]).float().sum(0).to(do.dtype) for j in (1, 2))
            grads.append((torch.cat([p[0] for p in parts], 1), dk, dv))
            del parts
        del qr  # before the next call's rows exist
    dk, dv = (torch.cat([g[j] for g in grads]) for j in (1, 2))
    if dq_parts:
        return [(i * rows, g[0]) for i, g in enumerate(grads)], dk, dv
    return torch.cat([g[0] for g in grads]), dk, dv


def _backward_call(do, q, k, v, o, lse, seed, offset, scale: float):
    """One cuDNN backward call of cudnn_forward's (causal, no dropout)."""
    L = q.shape[2]
    return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        do, q, k, v, o, lse, seed, offset, None, None, None, L, L, 0.0, True, scale=scale)


class _CudnnCausal(torch.autograd.Function):
    """cudnn_forward with autograd through cudnn_backward."""

    @staticmethod
    def forward(ctx, q, k, v, scale: float):
        o, lse, seed, offset = cudnn_forward(q, k, v, scale)
        ctx.save_for_backward(q, k, v, o, lse, seed, offset)
        ctx.scale = scale
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        return (*cudnn_backward(do, *ctx.saved_tensors, ctx.scale), None)


def causal_attention_lse(q, k, v, scale: float):
    """Attend in plain torch (at least fp32): the same results as cudnn_attention_lse."""
    dtype = torch.promote_types(q.dtype, torch.float32)
    s = (q.to(dtype) @ k.to(dtype).transpose(-1, -2)) * scale
    L = q.shape[2]
    causal = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
    s = s.masked_fill(~causal, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    o = torch.softmax(s, dim=-1) @ v.to(dtype)
    return o.to(q.dtype), lse.float()


def causal_attention_backward(do, q, k, v, o, lse, scale: float):
    """(dq, dk, dv) of causal_attention_lse in plain torch (at least fp32), from its o and lse
    ([N, H, L], natural log): P = exp(S - lse), dS = P (dO V^T - rowsum(dO o)), dK / dV summed over
    the query heads of each kv head."""
    dtype = torch.promote_types(q.dtype, torch.float32)
    N, H, L, _ = q.shape
    Hk = k.shape[1]
    qf, kf, vf, of, dof = (t.to(dtype) for t in (q, k, v, o, do))
    kr, vr = (t.repeat_interleave(H // Hk, dim=1) for t in (kf, vf))
    s = (qf @ kr.transpose(-1, -2)) * scale
    causal = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
    p = torch.exp(s - lse.reshape(N, H, L, 1).to(dtype)).masked_fill(~causal, 0.0)
    ds = p * (dof @ vr.transpose(-1, -2) - (dof * of).sum(-1, keepdim=True))
    dq = (ds @ kr) * scale
    dk = ((ds.transpose(-1, -2) @ qf) * scale).view(N, Hk, H // Hk, L, -1).sum(2)
    dv = (p.transpose(-1, -2) @ dof).view(N, Hk, H // Hk, L, -1).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def grouped_rows(rows: int, config: NSAConfig, Tc: int) -> int:
    """Folded query rows the grouped call reads: the (l-1)*G rows before the first group, then Tc
    groups of d*G rows, the last one padded past the `rows` real ones."""
    G = config.group_size
    return max(rows, min(rows, (config.cmp_block - 1) * G) + Tc * config.cmp_stride * G)


def to_grouped(rows: torch.Tensor, groups: int) -> torch.Tensor:
    """Folded rows [B, Hkv, Tc*dG, D] of `groups` = Tc groups as the call's [B*Hkv, dG, Tc, D] (group I,
    row j -> position I, head j). A view where the rows are (as cuDNN's output, and what the
    branches write in its layout)."""
    B, Hkv, n, D = rows.shape
    dG = n // groups
    return rows.view(B, Hkv, groups, dG, D).transpose(2, 3).reshape(B * Hkv, dG, groups, D)


def from_grouped(x4: torch.Tensor) -> torch.Tensor:
    """The call's [N, dG, Tc, D] (position I, head j) as folded rows [N, Tc*dG, D] (row I*dG + j):
    to_grouped's inverse, a view where x4 is laid out as the call's queries."""
    N, dG, Tc, D = x4.shape
    return x4.transpose(1, 2).reshape(N, Tc * dG, D)


def _operands(q_fold, k_cmp, v_cmp, config: NSAConfig, q_room):
    """(q4 [B*Hkv, dG, Tc, Dk] a view of q_room's rows, k4 / v4 [B*Hkv, 1, Tc, D], head rows)."""
    B, Hkv, rows, Dk = q_fold.shape
    Tc, Dv = k_cmp.shape[1], v_cmp.shape[-1]
    G, l, d = config.group_size, config.cmp_block, config.cmp_stride
    head = min(rows, (l - 1) * G)  # rows of the tokens before the first complete block: o = 0, lse = -inf
    need = grouped_rows(rows, config, Tc)
    if q_room is None:
        q_room = F.pad(q_fold, (0, 0, 0, need - rows))
    elif q_room.shape[2] < need or q_room.shape[:2] != q_fold.shape[:2]:
        raise ValueError(f"q_room {tuple(q_room.shape)} must be [{B}, {Hkv}, >= {need}, {Dk}] (grouped_rows)")
    # Group I holds folded rows head + I*d*G ... (I+1)*d*G - 1.
    q4 = to_grouped(q_room[:, :, head:head + Tc * d * G], Tc)
    k4 = k_cmp.transpose(1, 2).reshape(B * Hkv, 1, Tc, Dk)
    v4 = v_cmp.transpose(1, 2).reshape(B * Hkv, 1, Tc, Dv)
    return q4, k4, v4, head


def _results(o4, lse4, config: NSAConfig, B: int, Hkv: int, T: int, head: int) -> tuple[FoldedRows, torch.Tensor]:
    """The call's (o4, lse4) as compressed_grouped returns them."""
    N, dG, Tc, Dv = o4.shape
    G, d = config.group_size, config.cmp_stride
    # cuDNN lays its output out like q4 (a group's rows innermost): then this is a view.
    o = from_grouped(o4).view(B, Hkv, Tc * dG, Dv)
    # lse4 [B*Hkv, d*G, Tc], head j*G + g of group I -> lse [B, Hkv*G, T] at token l - 1 + I*d + j.
    lse = lse4.reshape(B, Hkv, d, G, Tc).permute(0, 1, 3, 4, 2).reshape(B, Hkv * G, Tc * d)[..., :T - head // G]
    lse = torch.cat([lse.new_full((B, Hkv * G, head // G), float("-inf")), lse.float()], dim=-1)
    return FoldedRows(o, head), lse


def compressed_grouped(q_fold: torch.Tensor, k_cmp: torch.Tensor, v_cmp: torch.Tensor, config: NSAConfig,
                       scale: float, attend: Attend = causal_attention_lse,
                       q_room: torch.Tensor | None = None) -> tuple[FoldedRows, torch.Tensor]:
    """(o: FoldedRows [B, Hkv, Tc*d*G, Dv] from row (l-1)*G on, in q's dtype; lse [B, Hq, T] fp32, -inf
    where no block is complete).

    q_fold [B, Hkv, T*G, Dk] (folded, see nsa_flex.folded), k_cmp / v_cmp [B, Tc, Hkv, D] with Tc >= 1.
    o is a view of the call's output: the rows before the first group (zero) are not stored, and
    the last group's rows past T*G are padding. q_room: the folded queries with grouped_rows(...)
    rows (q_fold is its first T*G rows, the rest ignored). The call's queries are then a view of
    it, so the copy the backward keeps is the one the other branches keep anyway; without it the
    rows are padded into a new tensor here.
    """
    B, Hkv, rows, _ = q_fold.shape
    q4, k4, v4, head = _operands(q_fold, k_cmp, v_cmp, config, q_room)
    o4, lse4 = attend(q4, k4, v4, scale)
    return _results(o4, lse4, config, B, Hkv, rows // config.group_size, head)


class Grouped(NamedTuple):
    """The grouped call made without a gradient of its own (compressed_grouped_detached): what its
    backward (grouped_backward) takes besides o and dO, for an autograd node that runs it."""

    q: torch.Tensor
    """[B*Hkv, d*G, Tc, Dk], a view of q_room's rows (its gradient is theirs)."""
    k: torch.Tensor
    """[B*Hkv, 1, Tc, Dk] (its gradient goes to k_cmp)."""
    v: torch.Tensor
    """[B*Hkv, 1, Tc, Dv]."""
    lse: torch.Tensor
    """The call's lse, natural log, as the call returned it."""
    seed: torch.Tensor | None
    """cuDNN's seed and offset (None where the torch call ran)."""
    offset: torch.Tensor | None
    cudnn: bool
    """Whether cuDNN made it (else causal_attention_lse)."""


def compressed_grouped_detached(q_fold: torch.Tensor, k_cmp: torch.Tensor, v_cmp: torch.Tensor, config: NSAConfig,
                                scale: float, cudnn: bool,
                                q_room: torch.Tensor | None = None) -> tuple[FoldedRows, torch.Tensor, Grouped]:
    """compressed_grouped's (o, lse), with no gradient through them, and the Grouped the caller's
    autograd node hands grouped_backward: its gradients of Grouped.q / .k / .v are those of q_room
    and k_cmp / v_cmp. cudnn: cuDNN's call (cudnn_applies), else causal_attention_lse. Lets the
    node run this backward where it chooses (ops.gated_branches: before the window and selected
    branches', so that the call's buffers are gone before theirs exist)."""
    B, Hkv, rows, _ = q_fold.shape
    q4, k4, v4, head = _operands(q_fold, k_cmp, v_cmp, config, q_room)
    cudnn = cudnn and q4.shape[2] > 1  # one compressed token: cuDNN rejects s_q = s_kv = 1
    if cudnn:
        o4, lse4, seed, offset = cudnn_forward(q4.detach(), k4.detach(), v4.detach(), scale)
    else:
        (o4, lse4), seed, offset = causal_attention_lse(q4.detach(), k4.detach(), v4.detach(), scale), None, None
    o, lse = _results(o4, lse4, config, B, Hkv, rows // config.group_size, head)
    return o, lse, Grouped(q4, k4, v4, lse4, seed, offset, cudnn)


def grouped_backward(do4, o4, q4, k4, v4, lse4, seed, offset, cudnn: bool, scale: float, dq_parts: bool = False):
    """(dq4, dk4, dv4) of compressed_grouped_detached's call, from its output gradient do4 and output
    o4 ([B*Hkv, dG, Tc, Dv], to_grouped of the folded rows) and the Grouped fields; q4 the call's
    queries or Queries (cudnn_backward's q); dq_parts: dq4 as cudnn_backward gives it so."""
    if cudnn:
        return cudnn_backward(do4, q4, k4, v4, o4, lse4, seed, offset, scale, dq_parts)
    q4 = q4(0, do4.shape[0]) if callable(q4) else q4
    dq, dk, dv = causal_attention_backward(do4, q4, k4, v4, o4, lse4, scale)
    return ([(0, dq)] if dq_parts else dq), dk, dv
