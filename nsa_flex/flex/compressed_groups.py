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
call in plain torch, for other devices and the tests.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from nsa_flex.config import NSAConfig
from nsa_flex.folded import FoldedRows
from nsa_flex.ops.selected_attention.launch import PARTIAL_BYTES

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
    s_q = s_kv = 1. The backward runs in slices of the batch (_CudnnCausal).
    """
    if q.shape[2] == 1:
        return causal_attention_lse(q, k, v, scale)
    o, lse = _CudnnCausal.apply(q, k, v, scale)
    return o, lse.reshape(q.shape[:3])


def backward_slices(N: int, H: int, Hk: int, L: int, Dk: int, Dv: int) -> int:
    """Batch rows per cuDNN backward call of _CudnnCausal (N rows of H query heads on Hk kv heads,
    L positions).

    With GQA (Hk < H) cuDNN's backward holds dK and dV of every query head in fp32 before it sums
    them per kv head: 4 H L (Dk + Dv) bytes a batch row. In the grouped call H is d*G (256 at
    G=16), so at 64k that buffer was the op's peak: 4.0 GiB at G=16 (docs/decisions.md, "The
    compressed branch as one cuDNN call"). So a call takes as many rows as keep it within the
    bound of the selected op's partials (PARTIAL_BYTES), at least one; a row's gradients come out
    of one call as before. Each call more costs time (~0.1-0.2 ms at 64k), so rows that fit go in
    one call.
    """
    if Hk >= H:
        return N
    return max(1, min(N, PARTIAL_BYTES // max(1, 4 * H * L * (Dk + Dv))))


class _CudnnCausal(torch.autograd.Function):
    """aten._scaled_dot_product_cudnn_attention (causal, lse), its backward in slices of the batch."""

    @staticmethod
    def forward(ctx, q, k, v, scale: float):
        o, lse, _, _, max_q, max_k, seed, offset, _ = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, True, False, scale=scale)
        ctx.save_for_backward(q, k, v, o, lse, seed, offset)
        ctx.args = (max_q, max_k, scale)
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, o, lse, seed, offset = ctx.saved_tensors
        max_q, max_k, scale = ctx.args
        N = q.shape[0]
        step = backward_slices(N, q.shape[1], k.shape[1], q.shape[2], q.shape[3], v.shape[3])
        grads = [torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            do[i:i + step], q[i:i + step], k[i:i + step], v[i:i + step], o[i:i + step], lse[i:i + step], seed, offset,
            None, None, None, max_q, max_k, 0.0, True, scale=scale) for i in range(0, N, step)]
        if len(grads) == 1:
            return (*grads[0], None)
        return (*(torch.cat(parts) for parts in zip(*grads)), None)


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


def grouped_rows(rows: int, config: NSAConfig, Tc: int) -> int:
    """Folded query rows the grouped call reads: the (l-1)*G rows before the first group, then Tc
    groups of d*G rows, the last one padded past the `rows` real ones."""
    G = config.group_size
    return max(rows, min(rows, (config.cmp_block - 1) * G) + Tc * config.cmp_stride * G)


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
    B, Hkv, rows, Dk = q_fold.shape
    Tc, Dv = k_cmp.shape[1], v_cmp.shape[-1]
    G, l, d = config.group_size, config.cmp_block, config.cmp_stride
    T = rows // G
    head = min(rows, (l - 1) * G)  # rows of the tokens before the first complete block: o = 0, lse = -inf
    dG = d * G
    need = grouped_rows(rows, config, Tc)
    if q_room is None:
        q_room = F.pad(q_fold, (0, 0, 0, need - rows))
    elif q_room.shape[2] < need or q_room.shape[:2] != q_fold.shape[:2]:
        raise ValueError(f"q_room {tuple(q_room.shape)} must be [{B}, {Hkv}, >= {need}, {Dk}] (grouped_rows)")
    # Group I holds folded rows head + I*d*G ... (I+1)*d*G - 1.
    x = q_room[:, :, head:head + Tc * dG]
    q4 = x.view(B, Hkv, Tc, dG, Dk).transpose(2, 3).reshape(B * Hkv, dG, Tc, Dk)
    k4 = k_cmp.transpose(1, 2).reshape(B * Hkv, 1, Tc, Dk)
    v4 = v_cmp.transpose(1, 2).reshape(B * Hkv, 1, Tc, Dv)
    o4, lse4 = attend(q4, k4, v4, scale)
    # cuDNN lays its output out like q4 (a group's rows innermost): then this is a view.
    o = o4.view(B, Hkv, dG, Tc, Dv).transpose(2, 3).reshape(B, Hkv, Tc * dG, Dv)
    # lse4 [B*Hkv, d*G, Tc], head j*G + g of group I -> lse [B, Hkv*G, T] at token l - 1 + I*d + j.
    lse = lse4.view(B, Hkv, d, G, Tc).permute(0, 1, 3, 4, 2).reshape(B, Hkv * G, Tc * d)[..., :T - head // G]
    lse = torch.cat([lse.new_full((B, Hkv * G, head // G), float("-inf")), lse.float()], dim=-1)
    return FoldedRows(o, head), lse
