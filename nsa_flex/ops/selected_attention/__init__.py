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
from nsa_flex.ops.selected_attention import kernels, launch, twin
from nsa_flex.ops.triton_utils import quiet_without_triton

_IMPLS = ("auto", "triton", "torch")
_KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def selected_attention(q: Tensor, k: Tensor, v: Tensor, block_indices: Tensor, config: NSAConfig, *,
                       scale: float | None = None, cu_seqlens: Tensor | None = None, impl: str = "auto") -> Tensor:
    """o [B,T,Hq,Dv] in q's dtype; differentiable in q, k, v.

    q [B,T,Hq,Dk], k [B,T,Hkv,Dk], v [B,T,Hkv,Dv] (one dtype), block_indices [B,Hkv,T,n] int32/int64
    (-1 unused; ascending as the selection op gives them, though order does not matter; a block
    listed twice in a row counts once, as in the reference's mask). Blocks are config.sel_block tokens. cu_seqlens [n_docs+1] (B == 1): packed
    documents with document-local block ids. impl: "auto" (Triton on CUDA, else the twin),
    "triton" (the kernels on any device: CPU only under TRITON_INTERPRET=1) or "torch" (the twin).
    """
    _check_inputs(q, k, v, block_indices, cu_seqlens, impl)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    o, _ = torch.ops.nsa_flex.selected_attention(q, k, v, block_indices, cu_seqlens, scale, config.sel_block, impl)
    return o


def _use_triton(q: Tensor, impl: str) -> bool:
    if impl == "triton":
        return True
    return impl == "auto" and q.device.type == "cuda" and kernels.HAS_TRITON


def _forward_impl(q: Tensor, k: Tensor, v: Tensor, block_indices: Tensor, cu_seqlens: Optional[Tensor],
                  scale: float, sel_block: int, impl: str) -> tuple[Tensor, Tensor]:
    if _use_triton(q, impl):
        return launch.forward(q, k, v, block_indices, cu_seqlens, scale, sel_block)
    return twin.forward(q, k, v, block_indices, cu_seqlens, scale, sel_block)


def _backward_impl(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, block_indices: Tensor,
                   cu_seqlens: Optional[Tensor], scale: float, sel_block: int,
                   impl: str) -> tuple[Tensor, Tensor, Tensor]:
    if _use_triton(q, impl):
        return launch.backward(do, q, k, v, o, lse, block_indices, cu_seqlens, scale, sel_block)
    return twin.backward(do, q, k, v, o, lse, block_indices, cu_seqlens, scale, sel_block)


with quiet_without_triton():
    _forward_op = triton_op("nsa_flex::selected_attention", mutates_args=())(_forward_impl)
    _backward_op = triton_op("nsa_flex::selected_attention_backward", mutates_args=())(_backward_impl)


@_forward_op.register_fake
def _forward_fake(q, k, v, block_indices, cu_seqlens, scale, sel_block, impl):
    B, T, Hq, _ = q.shape
    return q.new_empty(B, T, Hq, v.shape[-1]), q.new_empty(B, Hq, T, dtype=torch.float32)


@_backward_op.register_fake
def _backward_fake(do, q, k, v, o, lse, block_indices, cu_seqlens, scale, sel_block, impl):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, block_indices, cu_seqlens, scale, sel_block, impl = inputs
    o, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, o, lse, block_indices, cu_seqlens)
    ctx.args = (scale, sel_block, impl)


def _backward(ctx, do, _dlse):
    q, k, v, o, lse, block_indices, cu_seqlens = ctx.saved_tensors
    dq, dk, dv = torch.ops.nsa_flex.selected_attention_backward(do, q, k, v, o, lse, block_indices, cu_seqlens,
                                                                *ctx.args)
    return dq, dk, dv, None, None, None, None, None


_forward_op.register_autograd(_backward, setup_context=_setup_context)


def _check_inputs(q, k, v, block_indices, cu_seqlens, impl) -> None:
    """Shape, dtype and device checks; every error says what was wrong and what is allowed."""
    if impl not in _IMPLS:
        raise ValueError(f"impl={impl!r}; allowed: {', '.join(_IMPLS)}")
    for name, x, dims in (("q", q, "[B, T, Hq, Dk]"), ("k", k, "[B, T, Hkv, Dk]"), ("v", v, "[B, T, Hkv, Dv]"),
                          ("block_indices", block_indices, "[B, Hkv, T, n]")):
        if not isinstance(x, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 4:
            raise ValueError(f"{name} must be {dims}, got shape {tuple(x.shape)}")
        if x.device != q.device:
            raise ValueError(f"{name} is on {x.device} but q is on {q.device}; inputs must share one device")
    B, T, Hq, Dk = q.shape
    Hkv = k.shape[2]
    if k.shape[:2] != (B, T) or k.shape[3] != Dk or v.shape[:3] != k.shape[:3]:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} do not fit q {tuple(q.shape)}: "
                         f"expected k [{B}, {T}, Hkv, {Dk}] and v [{B}, {T}, Hkv, Dv]")
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"q's {Hq} heads must be a multiple of k's {Hkv} kv heads")
    if block_indices.shape[:3] != (B, Hkv, T) or block_indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"block_indices must be int32/int64 [B, Hkv, T, n] = [{B}, {Hkv}, {T}, n], got "
                         f"{tuple(block_indices.shape)} {block_indices.dtype}")
    allowed = _KERNEL_DTYPES if _use_triton(q, impl) else _KERNEL_DTYPES + (torch.float64,)
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
