"""Top-n selection of key blocks from the compressed branch: the op nsa_flex::select_blocks.

The compressed branch returns its log-sum-exp (FlexAttention's `return_lse`), never its
probabilities, so the op recomputes p_cmp = exp(scale * q . k_cmp - lse) on the visible
compression blocks, maps compression blocks to selection blocks by their overlap
(blocks.cmp_to_sel_weights: 1, 2, 2, 2, 1 for l=32, d=16, l'=64), sums the G query heads of
each GQA group, forces the first n_initial and the n_local blocks ending at the query's own,
drops blocks after the query's own and keeps the top n. Tie-break: equal scores take the
lower block index first. Output [B, Hkv, T, n] int32: ascending block ids, -1 (unused) last.
On long sequences the CUDA kernel ranks each score with its low mantissa bits cleared (17 of
23 kept at T = 64k, see kernels.list_tile_bits): a relative rounding below 2^-17 there, finer
than the fp32 scores' own error.

On CUDA the op runs a streaming Triton kernel (ops/select/kernels.py) that never writes the
[T, Tc] score matrix; elsewhere, or without Triton, it runs the torch twin below. The choice
is made inside the op body: a register_kernel("cpu") fallback would be skipped under
torch.compile (docs/design.md, "FlexAttention facts").

lse base: FlexAttention's kernels work in base 2, but torch.nn.attention.flex_attention
multiplies the lse by ln 2 before returning it (`_finalize_outputs`, `stats_are_log2`, read
in torch 2.13). On the H200 with torch 2.11 the compiled flex_attention's lse matched the
natural-log logsumexp to 9.5e-7 (and missed the base-2 one by 2.9;
docs/records/select_op_h200.json). So the op takes the lse that
flex_attention(..., return_lse=True) returns, as is.
"""

# No `from __future__ import annotations` here: torch.library reads the op's annotations.
from typing import Optional

import torch
from torch import Tensor
from torch.library import triton_op

from nsa_flex.blocks import cmp_to_sel_weights, document_of, num_sel_blocks, top_n_blocks
from nsa_flex.config import NSAConfig
from nsa_flex.ops.select import kernels
from nsa_flex.ops.triton_utils import quiet_without_triton

# Score elements (B * Hq * rows * Tc) the twin holds at once: bounds its memory for any T.
_TWIN_CHUNK_ELEMENTS = 1 << 22
_KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_TWIN_DTYPES = _KERNEL_DTYPES + (torch.float64,)


def select_blocks(
    q: Tensor,
    k_cmp: Tensor,
    lse_cmp: Tensor,
    config: NSAConfig,
    *,
    scale: float | None = None,
    cu_seqlens: Tensor | None = None,
    cu_seqlens_cmp: Tensor | None = None,
) -> Tensor:
    """Selected blocks of every (kv head, query) -> [B, Hkv, T, n] int32.

    q [B,T,Hq,Dk], k_cmp [B,Tc,Hkv,Dk] (same dtype), lse_cmp [B,Hq,T] float32: the natural-log
    log-sum-exp of scale * q . k_cmp over the visible compression blocks (-inf where none is).
    scale defaults to Dk ** -0.5. With cu_seqlens (B == 1, packed documents, [N+1]) and
    cu_seqlens_cmp (compression.compressed_seqlens of it) each document selects on its own
    and block ids are document-local.
    """
    _check_inputs(q, k_cmp, lse_cmp, cu_seqlens, cu_seqlens_cmp)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return torch.ops.nsa_flex.select_blocks(
        q, k_cmp, lse_cmp, cu_seqlens, cu_seqlens_cmp, scale, *_geometry(config)
    )


def select_blocks_torch(
    q: Tensor,
    k_cmp: Tensor,
    lse_cmp: Tensor,
    config: NSAConfig,
    *,
    scale: float | None = None,
    cu_seqlens: Tensor | None = None,
    cu_seqlens_cmp: Tensor | None = None,
) -> Tensor:
    """The torch twin of select_blocks, on any device: same arguments, same result."""
    _check_inputs(q, k_cmp, lse_cmp, cu_seqlens, cu_seqlens_cmp)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return _select_torch(q, k_cmp, lse_cmp, cu_seqlens, cu_seqlens_cmp, scale, config)


def _select_blocks_impl(
    q: Tensor,
    k_cmp: Tensor,
    lse_cmp: Tensor,
    cu_seqlens: Optional[Tensor],
    cu_seqlens_cmp: Optional[Tensor],
    scale: float,
    cmp_block: int,
    cmp_stride: int,
    sel_block: int,
    n_selected: int,
    n_initial: int,
    n_local: int,
) -> Tensor:
    # Only the geometry fields are read; head counts come from the tensors (and may be symbolic).
    config = NSAConfig(cmp_block=cmp_block, cmp_stride=cmp_stride, sel_block=sel_block,
                       n_selected=n_selected, n_initial=n_initial, n_local=n_local)
    if q.device.type == "cuda" and kernels.HAS_TRITON:
        return kernels.select_blocks_triton(q, k_cmp, lse_cmp, cu_seqlens, cu_seqlens_cmp, scale, config)
    return _select_torch(q, k_cmp, lse_cmp, cu_seqlens, cu_seqlens_cmp, scale, config)


with quiet_without_triton():
    _select_blocks_op = triton_op("nsa_flex::select_blocks", mutates_args=())(_select_blocks_impl)


@_select_blocks_op.register_fake
def _select_blocks_fake(q, k_cmp, lse_cmp, cu_seqlens, cu_seqlens_cmp, scale, cmp_block, cmp_stride,
                        sel_block, n_selected, n_initial, n_local):
    B, T = q.shape[:2]
    return q.new_empty((B, k_cmp.shape[2], T, n_selected), dtype=torch.int32)


def _select_torch(q, k_cmp, lse, cu_seqlens, cu_seqlens_cmp, scale: float, config: NSAConfig) -> Tensor:
    """The twin: fp32 (or fp64) math, row chunks of at most _TWIN_CHUNK_ELEMENTS scores."""
    B, T, Hq, Dk = q.shape
    Tc, Hkv = k_cmp.shape[1], k_cmp.shape[2]
    G = Hq // Hkv
    Ns = num_sel_blocks(T, config)
    dtype = torch.promote_types(q.dtype, torch.float32)
    t = torch.arange(T, device=q.device)
    if cu_seqlens is None:
        t_local, cmp_start, cmp_len = t, None, torch.full_like(t, Tc)
    else:
        cu, cu_cmp = cu_seqlens.long(), cu_seqlens_cmp.long()
        doc = document_of(cu, t)
        t_local, cmp_start = t - cu[doc], cu_cmp[doc]
        cmp_len = cu_cmp[doc + 1] - cmp_start
    # Compression block i of the token's document vs selection block j, both document-local.
    weights_cs = cmp_to_sel_weights(Tc, Ns, config, dtype=dtype, device=q.device)
    k_bhcd = k_cmp.to(dtype).permute(0, 2, 3, 1)  # [B, Hkv, Dk, Tc]
    rows = max(1, _TWIN_CHUNK_ELEMENTS // max(1, B * Hq * Tc))
    out = []
    for t0 in range(0, T, rows):
        t1 = min(T, t0 + rows)
        q_bhgtd = q[:, t0:t1].to(dtype).reshape(B, t1 - t0, Hkv, G, Dk).permute(0, 2, 3, 1, 4)
        lse_bhgt = lse[:, :, t0:t1].reshape(B, Hkv, G, t1 - t0)
        p = _cmp_probs(q_bhgtd @ k_bhcd[:, :, None], lse_bhgt, t_local[t0:t1],
                       None if cmp_start is None else cmp_start[t0:t1], cmp_len[t0:t1], scale, config)
        importance = (p @ weights_cs).sum(2)  # [B, Hkv, rows, Ns]
        out.append(top_n_blocks(importance, t_local[t0:t1], config))
    return torch.cat(out, dim=2).to(torch.int32)


def _cmp_probs(s_bhgtc, lse_bhgt, t_local, cmp_start, cmp_len, scale: float, config: NSAConfig) -> Tensor:
    """p_cmp of a row chunk on document-local compression blocks, 0 where not visible."""
    Tc = s_bhgtc.shape[-1]
    i = torch.arange(Tc, device=s_bhgtc.device)
    if cmp_start is not None and Tc > 0:
        # Packed documents: column i of a row is its document's i-th compressed token.
        cols_tc = (cmp_start[:, None] + i[None, :]).clamp(max=Tc - 1)
        s_bhgtc = torch.gather(s_bhgtc, -1, cols_tc.expand_as(s_bhgtc))
    visible_tc = (i[None, :] < cmp_len[:, None]) & (
        i[None, :] * config.cmp_stride + config.cmp_block - 1 <= t_local[:, None]
    )
    p = torch.exp(s_bhgtc * scale - lse_bhgt[..., None].to(s_bhgtc.dtype))
    return torch.where(visible_tc, p, torch.zeros_like(p))


def _geometry(config: NSAConfig) -> tuple[int, ...]:
    """The config fields the op needs, as the op's int arguments."""
    return (config.cmp_block, config.cmp_stride, config.sel_block, config.n_selected,
            config.n_initial, config.n_local)


def _check_inputs(q, k_cmp, lse_cmp, cu_seqlens, cu_seqlens_cmp) -> None:
    """Shape, dtype and device checks; every error says what was wrong and what is allowed."""
    for name, x, dims in (("q", q, "[B, T, Hq, Dk]"), ("k_cmp", k_cmp, "[B, Tc, Hkv, Dk]"),
                          ("lse_cmp", lse_cmp, "[B, Hq, T]")):
        if not isinstance(x, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != len(dims.split(",")):
            raise ValueError(f"{name} must be {dims}, got shape {tuple(x.shape)}")
        if x.device != q.device:
            raise ValueError(f"{name} is on {x.device} but q is on {q.device}; inputs must share one device")
    allowed = _KERNEL_DTYPES if q.is_cuda else _TWIN_DTYPES
    if q.dtype not in allowed:
        raise TypeError(f"q has dtype {q.dtype}; allowed on {q.device.type}: {', '.join(map(str, allowed))}")
    if k_cmp.dtype != q.dtype:
        raise TypeError(f"k_cmp has dtype {k_cmp.dtype} but q has {q.dtype}; they must match")
    if lse_cmp.dtype != torch.float32:
        raise TypeError(f"lse_cmp must be float32 (what flex_attention returns), got {lse_cmp.dtype}")
    B, T, Hq, Dk = q.shape
    if k_cmp.shape[0] != B or k_cmp.shape[3] != Dk:
        raise ValueError(f"k_cmp shape {tuple(k_cmp.shape)} does not fit q {tuple(q.shape)}: "
                         f"expected [{B}, Tc, Hkv, {Dk}]")
    if k_cmp.shape[2] == 0 or Hq % k_cmp.shape[2] != 0:
        raise ValueError(f"q's {Hq} heads must be a multiple of k_cmp's {k_cmp.shape[2]} kv heads")
    if tuple(lse_cmp.shape) != (B, Hq, T):
        raise ValueError(f"lse_cmp must be [B, Hq, T] = {[B, Hq, T]}, got {list(lse_cmp.shape)}")
    _check_varlen(q, k_cmp, cu_seqlens, cu_seqlens_cmp)


def _check_varlen(q, k_cmp, cu_seqlens, cu_seqlens_cmp) -> None:
    if (cu_seqlens is None) != (cu_seqlens_cmp is None):
        raise ValueError("pass cu_seqlens and cu_seqlens_cmp together (or neither)")
    if cu_seqlens is None:
        return
    if q.shape[0] != 1:
        raise ValueError(f"packed documents (cu_seqlens) need batch size 1, got B={q.shape[0]}")
    for name, x in (("cu_seqlens", cu_seqlens), ("cu_seqlens_cmp", cu_seqlens_cmp)):
        if x.dim() != 1 or x.shape[0] < 2 or x.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be a 1-D int32/int64 tensor [N+1], got "
                             f"shape {tuple(x.shape)} dtype {x.dtype}")
        if x.device != q.device:
            raise ValueError(f"{name} is on {x.device} but q is on {q.device}")
    if cu_seqlens.shape != cu_seqlens_cmp.shape:
        raise ValueError(f"cu_seqlens {tuple(cu_seqlens.shape)} and cu_seqlens_cmp "
                         f"{tuple(cu_seqlens_cmp.shape)} must describe the same documents")
